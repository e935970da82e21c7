"""Structured output on the first try: of 20 JSON schemas written as a newcomer writes them (no bounds, no
`additionalProperties`), how many complete on the default model, at temperature 0 and 0.7.

    .venv/bin/tokenloop-bench structured_first_try        # starts `tokenloop serve` on the default model
    .venv/bin/tokenloop-bench structured_first_try --address HOST:PORT --out bench/results-structured-first-try.json

Each case is one chat prompt and one schema, sent as is with the CLI's defaults (the server's default
max_new_tokens, 256); a case completes when its sequence ends at STRUCTURE_COMPLETE (or EOS) and its text is JSON
valid under the schema as sent (`jsonschema`). A correctness count, not a timing: it may run on a loaded machine.
Prints a Markdown table; `--out FILE` also writes the outcomes as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

import jsonschema

from tokenloop.bench import harness
from tokenloop_client import Client

TEMPERATURES = (0.0, 0.7)
SEED = 1


def _obj(required: bool = True, **props) -> dict:
    schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(props)
    return schema


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# (name, prompt, schema): what a newcomer types first, bounds left out
CASES = [
    ("city", "Give me a city and its population as JSON.", _obj(city=STR, population=INT)),
    ("person", "Make up a person with a name and an age.", _obj(name=STR, age=INT)),
    ("capital", "What is the capital of France? Answer in JSON.", _obj(country=STR, capital=STR)),
    ("book", "Recommend a book.", _obj(title=STR, author=STR, year=INT)),
    ("weather", "What's the weather like in London today?", _obj(city=STR, temperature=NUM, conditions=STR)),
    ("product", "Describe a product for an online shop.", _obj(name=STR, price=NUM, in_stock=BOOL)),
    ("sentiment", "Classify the sentiment of: 'I love this phone, the battery lasts forever.'",
     _obj(sentiment={"type": "string", "enum": ["positive", "negative", "neutral"]}, confidence=NUM)),
    ("todo", "Make a todo list for a Saturday.", _obj(items={"type": "array", "items": STR})),
    ("recipe", "Give me a simple pancake recipe.",
     _obj(name=STR, ingredients={"type": "array", "items": STR}, minutes=INT)),
    ("movie", "Tell me about a famous movie.", _obj(title=STR, director=STR, year=INT, rating=NUM)),
    ("user", "Create a user profile.", _obj(username=STR, email=STR, is_admin=BOOL)),
    ("point", "Give me a point on a map of Paris as latitude and longitude.", _obj(latitude=NUM, longitude=NUM)),
    ("answer", "Is the Earth flat? Answer yes or no and explain briefly.", _obj(answer=BOOL, explanation=STR)),
    ("colors", "List three colors.", {"type": "array", "items": STR}),
    ("address", "Write the address of a made-up company.",
     _obj(company=STR, address=_obj(street=STR, city=STR, zip=STR))),
    ("event", "Plan a birthday party.", _obj(title=STR, date=STR, guests=INT)),
    ("translation", "Translate 'good morning' into Spanish.", _obj(source=STR, target=STR, language=STR)),
    ("math", "What is 12 times 7?", _obj(question=STR, answer=INT)),
    ("tags", "Suggest tags for a blog post about hiking in the Alps.",
     _obj(title=STR, tags={"type": "array", "items": STR})),
    ("employee", "Create an employee record.", _obj(required=False, name=STR, department=STR, salary=INT)),
]
# `json_object` (any object, no schema), counted apart from the 20 schemas
JSON_OBJECT_CASES = [("any object: city", "Tell me about Tokyo as JSON.", None),
                     ("any object: person", "Make up a person and describe them in JSON.", None)]


def run_case(client: Client, prompt: str, schema: dict, temperature: float) -> dict:
    """One generation: its finish reason, tokens, and whether it completed with JSON valid under `schema`."""
    structure = {"json_schema": json.dumps(schema)} if schema is not None else {"json_object": True}
    result = client.chat([{"role": "user", "content": prompt}], **structure, temperature=temperature, seed=SEED)
    c = result.completions[0]
    valid = False
    if c.finish_reason.value in ("STRUCTURE_COMPLETE", "EOS"):
        try:
            value = json.loads(c.text)
            jsonschema.validate(value, schema if schema is not None else {"type": "object"})
            valid = True
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"finish_reason": c.finish_reason.value, "tokens": c.usage.completion_tokens, "complete": valid,
            "text": c.text[:160]}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "results-structured-first-try.json")
    ap.add_argument("--address", help="a running server (default: start `tokenloop serve --model MODEL`)")
    ap.add_argument("--cases", type=int, default=len(CASES) + len(JSON_OBJECT_CASES),
                    help="run the first N cases only (a quick check)")
    args = ap.parse_args(argv)
    if args.address:
        asyncio.run(harness.wait_ready(args.address))  # a server given by --address may still be loading
        rows, objects = run_cases(args.address, args.cases)
    else:
        with harness.TokenloopServer(args.model) as server:
            rows, objects = run_cases(server.address, args.cases)
    summary = {str(t): f"{sum(r[str(t)]['complete'] for r in rows)} / {len(rows)}" for t in TEMPERATURES}
    summary_objects = {str(t): f"{sum(r[str(t)]['complete'] for r in objects)} / {len(objects)}" for t in TEMPERATURES}
    print("schemas complete: " + ", ".join(f"temperature {t}: {v}" for t, v in summary.items()))
    print("json_object complete: " + ", ".join(f"temperature {t}: {v}" for t, v in summary_objects.items()))
    figures = {"model": args.model, "seed": SEED, "complete": summary, "json_object_complete": summary_objects,
               "cases": rows, "json_object_cases": objects}
    harness.write(args.out, figures)
    if args.json:
        print(json.dumps(figures))
    return 0


def run_cases(address: str, num_cases: int) -> tuple[list[dict], list[dict]]:
    """Each case at each temperature, a table row printed as it completes: (schema rows, json_object rows)."""
    rows, objects = [], []
    print("| case | " + " | ".join(f"temperature {t}" for t in TEMPERATURES) + " |\n| --- |" + " --- |" * len(TEMPERATURES))
    with Client(address) as client:
        for name, prompt, schema in CASES[:num_cases] + JSON_OBJECT_CASES[:max(0, num_cases - len(CASES))]:
            row = {"case": name, "prompt": prompt, "schema": schema}
            for t in TEMPERATURES:
                row[str(t)] = run_case(client, prompt, schema, t)
            (rows if schema is not None else objects).append(row)
            print(f"| {name} | " + " | ".join(
                f"{'complete' if row[str(t)]['complete'] else row[str(t)]['finish_reason']} ({row[str(t)]['tokens']})"
                for t in TEMPERATURES) + " |", flush=True)
    return rows, objects


if __name__ == "__main__":
    sys.exit(main())
