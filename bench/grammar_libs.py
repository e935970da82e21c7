"""xgrammar against llguidance on this CPU: compile time, per-token mask time and correctness on the test cases.

    .venv/bin/pip install xgrammar   # not a tokenloop dependency: only this comparison needs it
    .venv/bin/tokenloop-bench grammar_libs --model models/SmolLM2-135M-Instruct

For each JSON schema of bench/structured_cases.py, each library compiles it cold (no cache) and then walks
`--walks` random paths through it: at every step it fills the token bitmask (timed), a seeded RNG picks one of the
allowed tokens, and the matcher advances; a finished walk's text must parse and validate (`jsonschema`).
Both libraries run with the JSON layout tokenloop uses, `json.dumps`' separators and no other whitespace: with
their default (any whitespace between tokens) a random walk never ends (every run of both fails that way).
Prints a Markdown table; `--out FILE` also writes the figures as JSON (bench/results-grammar-libs.json holds the
recorded ones). A library that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tokenloop.bench.harness import DEFAULT_MODEL, add_out_argument, machine, write
from tokenloop.bench.structured_cases import SCHEMAS

MAX_STEPS = 400
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int):
        import llguidance
        import llguidance.torch  # noqa: F401 - the bitmask helpers

        self.llg = llguidance
        start = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.words = (vocab_size + 31) // 32

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walker(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, mask: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def advance(self, matcher, token: int) -> bool:
        """Consume `token`; True when the structure is complete."""
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int):
        import xgrammar
        from tokenizers import Tokenizer

        self.xgr = xgrammar
        start = time.perf_counter()
        vocab = Tokenizer.from_file(tokenizer_json).get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for text, i in vocab.items():
            if i < vocab_size:
                encoded[i] = text
        info = xgrammar.TokenizerInfo(encoded, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=[eos], add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.eos, self.words = eos, (vocab_size + 31) // 32

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def walker(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask: np.ndarray) -> None:
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(mask).view(1, -1))

    def advance(self, matcher, token: int) -> bool:
        if not matcher.accept_token(token):
            raise RuntimeError("token refused")
        return matcher.is_terminated() or self._only_stop(matcher)

    def _only_stop(self, matcher) -> bool:
        """Complete: only the stop token could follow (llguidance's `is_stopped`)."""
        import torch

        mask = torch.zeros((1, self.words), dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        return len(allowed) == 1 and allowed[0] == self.eos


def walk(lib, compiled, tokenizer, vocab_size: int, rng: random.Random) -> tuple[str, list[float]]:
    """One random path: (text, mask times in seconds)."""
    matcher = lib.walker(compiled)
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    ids, times = [], []
    for _ in range(MAX_STEPS):
        start = time.perf_counter()
        lib.fill(matcher, mask)
        times.append(time.perf_counter() - start)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
        token = int(allowed[rng.randrange(len(allowed))])
        ids.append(token)
        if lib.advance(matcher, token):
            break
    return tokenizer.decode(ids, skip_special_tokens=True), times


def measure(lib, tokenizer, vocab_size: int, walks: int) -> dict:
    import jsonschema

    compile_s, mask_s, failures, first = {}, [], [], {}
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        start = time.perf_counter()
        try:
            compiled = lib.compile(text)
        except Exception as exc:  # noqa: BLE001 - a schema the library refuses is a result
            failures.append(f"{name}: compile failed: {str(exc).splitlines()[0][:120]}")
            continue
        compile_s[name] = time.perf_counter() - start
        rng = random.Random(0)
        for i in range(walks):
            out, times = walk(lib, compiled, tokenizer, vocab_size, rng)
            if i == 0:
                first[name] = times[0]
            mask_s += times
            try:
                jsonschema.validate(json.loads(out), schema)
            except Exception as exc:  # noqa: BLE001 - invalid output is the failure being counted
                failures.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} in {out[:80]!r}")
    return {"library": lib.name, "setup_s": lib.setup_s, "compile_s": compile_s, "first_mask_s": first,
            "mask_p50_us": pct(mask_s, 0.5) * 1e6, "mask_p99_us": pct(mask_s, 0.99) * 1e6,
            "mask_mean_us": statistics.fmean(mask_s) * 1e6 if mask_s else float("nan"),
            "num_masks": len(mask_s), "failures": failures}


def import_seconds(module: str) -> float:
    import subprocess

    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    rows = ["| library | import s | tokenizer setup s | compile p50 / max ms | first mask p50 ms | "
            "mask p50 / p99 / mean µs | walks valid |", "| --- " * 7 + "|"]
    for r in results:
        c = list(r["compile_s"].values())
        walks = r["num_walks"]
        rows.append(f"| {r['library']} | {r['import_s']:.2f} | {r['setup_s']:.2f} | "
                    f"{statistics.median(c) * 1e3:.1f} / {max(c) * 1e3:.1f} | "
                    f"{statistics.median(r['first_mask_s'].values()) * 1e3:.2f} | "
                    f"{r['mask_p50_us']:.0f} / {r['mask_p99_us']:.0f} / {r['mask_mean_us']:.0f} | "
                    f"{walks - len(r['failures'])} / {walks} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--walks", type=int, default=20)
    add_out_argument(parser, "results-grammar-libs.json")
    args = parser.parse_args(argv)
    from tokenloop.core.tokenizer import ModelCard, Tokenizer

    card, tokenizer = ModelCard.from_dir(args.model), Tokenizer.from_dir(args.model)
    tokenizer_json = str(Path(args.model) / "tokenizer.json")
    results = []
    for cls, module in ((Llguidance, "llguidance"), (Xgrammar, "xgrammar")):
        if importlib.util.find_spec(module) is None:
            print(f"{module} is not installed: skipped", file=sys.stderr)
            continue
        lib = cls(tokenizer_json, card.vocab_size, card.eos_token_ids[0])
        result = measure(lib, tokenizer, card.vocab_size, args.walks)
        result.update(import_s=import_seconds(module), num_walks=args.walks * len(SCHEMAS))
        results.append(result)
        for failure in result["failures"]:
            print(f"{module}: {failure}", file=sys.stderr)
    where = machine()
    print(f"{where['date']}, {where['cpu']}, {where['cpus']} CPUs, {len(SCHEMAS)} schemas x {args.walks} walks\n\n"
          f"{table(results)}")
    write(args.out, {"walks_per_schema": args.walks, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
