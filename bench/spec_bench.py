"""Speculative decoding: tokenloop with `--speculative off` and `ngram` against llama.cpp's llama-server without and
with its own n-gram speculation, on grounded tasks and free chat (issue 40's table).

    .venv/bin/tokenloop-bench spec --llama-cpp DIR [--weights int4] [--streams 1,8] [--new-tokens 256]
        [--repeats 3] [--chat-streams 1,8,32] [--chat-repeats 7] [--llama-rounds 3]

Scenarios (chat-templated token ids from bench/spec_cases.py, the same ids to both servers; greedy, EOS ignored,
`--new-tokens` each):
  grounded: rewrite / extract / repeat a ~400-token passage given in the prompt (the output quotes it);
  chat:     free chat (the output does not repeat the prompt): speculation must cost nothing here.
Each (scenario, streams) row runs every arm `--repeats` times, interleaved round by round (arm A, B, C, then again),
and reports the median tok/s; the tokenloop arms also report GetLoad's acceptance rate and tokens per verification,
and the tokens drafted in the timed requests (their usage). Issue 40's gate for free chat (ngram >= 0.97x off, at 1,
8 and 32 streams) is judged per row on the paired ratios (ngram / off of each round, the arms of a round run back to
back): met when their median is >= GATE, and met by construction when the ngram arm drafted no token in any round
(a step with more decoding sequences than --speculative-max-batch-size drafts nothing: both arms then run the same
steps, and the ratio is the machine's noise, which the spread of the paired ratios shows).
llama-server runs with `-np` = the streams and 1,024 tokens of context per slot, plain and with each
`--spec-type` of `--llama-spec-types` (ngram-simple and ngram-map-k by default; `--spec-default` settings otherwise).
Timings are only meaningful on a quiet machine; `--out FILE` records them (bench/results-spec.json).
"""

from __future__ import annotations

import asyncio
import statistics

from tokenloop.bench.harness import TokenloopServer, parser, report, stream_generate
from tokenloop.bench.llama_server import LlamaClient, LlamaServer
from tokenloop.bench.spec_cases import chat_messages, grounded_messages
from tokenloop.core.tokenizer import Tokenizer

GATE = 0.97  # issue 40: free chat with speculation >= 0.97x speculation off in the same run


def prompts_for(model: str) -> dict[str, list[list[int]]]:
    tok = Tokenizer.from_dir(model)
    encode = lambda messages: tok.encode(tok.apply_chat_template(messages))  # noqa: E731
    return {"grounded": [encode(m) for m in grounded_messages().values()],
            "chat": [encode(m) for m in chat_messages()]}


def batch_of(prompts: list[list[int]], streams: int) -> list[list[int]]:
    """`streams` requests (at least one per prompt), cycling through the prompts."""
    return [prompts[i % len(prompts)] for i in range(max(streams, len(prompts)))]


async def load_spec(port: int) -> tuple[float, float]:
    import grpc

    from tokenloop.v1 import tokenloop_pb2 as pb
    from tokenloop.v1 import tokenloop_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        load = await tokenloop_pb2_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest())
    return load.spec_acceptance_rate, load.spec_tokens_per_step


def tokenloop_arm(name: str, model: str, flags: list[str]):
    """An arm: a function that runs (prompts, new tokens, streams) on a fresh server and returns its figures."""
    def run(prompts: list[list[int]], num_new: int, streams: int) -> dict:
        with TokenloopServer(model, flags) as server:
            asyncio.run(stream_generate(server.port, prompts[:1], [8], 1))  # warm-up
            result = asyncio.run(stream_generate(server.port, prompts, [num_new] * len(prompts), streams))
            acceptance, per_step = asyncio.run(load_spec(server.port))
        return {"tok_s": sum(result.num_tokens) / result.wall_s, "acceptance": acceptance,
                "tokens_per_step": per_step, "draft_tokens": sum(result.draft_tokens)}
    run.arm = name
    return run


def llama_arm(name: str, build_dir: str, gguf: str | None, spec_type: str | None):
    def run(prompts: list[list[int]], num_new: int, streams: int) -> dict:
        from tokenloop.bench.harness import free_port

        flags = ("-t", "2", "-tb", "2", "-c", str(1024 * streams), "-np", str(streams), "-cb", "--no-webui")
        if spec_type:
            flags += ("--spec-type", spec_type)
        with LlamaServer(build_dir, free_port(), gguf, flags) as server:
            client = LlamaClient(server.url)
            asyncio.run(client.run(prompts[:1], [8], 1))  # warm-up
            wall, done = asyncio.run(client.run(prompts, [num_new] * len(prompts), streams))
        return {"tok_s": sum(c.num_tokens for c in done) / wall,
                "acceptance": _llama_acceptance(done)}
    run.arm = name
    return run


def _llama_acceptance(done) -> float | None:
    drafted = sum(c.timings.get("draft_n", 0) for c in done)
    return sum(c.timings.get("draft_n_accepted", 0) for c in done) / drafted if drafted else None


def gate(off: list[dict], ngram: list[dict]) -> dict:
    """The free-chat gate on one row's rounds (see the module's docstring): the paired ratios, their median and
    spread, the tokens the ngram arm drafted, and the verdict."""
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(off, ngram)]
    drafted = sum(r.get("draft_tokens", 0) for r in ngram)
    median = statistics.median(ratios)
    verdict = ("met by construction (no token drafted: both arms ran the same steps)" if drafted == 0
               else "met" if median >= GATE else "not met")
    return {"paired_ratios": ratios, "median_ratio": median, "spread": [min(ratios), max(ratios)],
            "draft_tokens": drafted, "verdict": verdict}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "results-spec.json")
    p.add_argument("--weights", default="int4", help="tokenloop's --weights for every tokenloop arm")
    p.add_argument("--scenarios", default="grounded,chat")
    p.add_argument("--streams", default="1,8", help="comma-separated stream counts (issue 40: 1,8; chat also 32)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="rounds per row; the median is reported")
    p.add_argument("--chat-streams", default=None, help="the chat rows' stream counts (default: --streams)")
    p.add_argument("--chat-repeats", type=int, default=None,
                   help="the chat rows' rounds (default: --repeats): the 0.97x gate needs more rounds than a 2x gain")
    p.add_argument("--llama-rounds", type=int, default=None,
                   help="llama-server's arms run in the first N rounds of each row only (default: every round)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR", help="a build_llamacpp.sh directory (llama-server)")
    p.add_argument("--gguf", default=None, help="the GGUF llama-server loads (default: the build directory's)")
    p.add_argument("--llama-spec-types", default="ngram-simple,ngram-map-k")
    args = p.parse_args(argv)
    prompts = prompts_for(args.model)
    base = ["--weights", args.weights]
    arms = [tokenloop_arm("tokenloop off", args.model, base + ["--speculative", "off"]),
            tokenloop_arm("tokenloop ngram", args.model, base + ["--speculative", "ngram"])]
    if args.llama_cpp:
        arms.append(llama_arm("llama-server", args.llama_cpp, args.gguf, None))
        arms += [llama_arm(f"llama-server {t}", args.llama_cpp, args.gguf, t)
                 for t in args.llama_spec_types.split(",") if t]
    rows = []
    for scenario in args.scenarios.split(","):
        chat = scenario == "chat"
        stream_counts = (args.chat_streams if chat and args.chat_streams else args.streams).split(",")
        repeats = args.chat_repeats if chat and args.chat_repeats else args.repeats
        for streams in (int(s) for s in stream_counts):
            batch = batch_of(prompts[scenario], streams)
            runs: dict[str, list[dict]] = {arm.arm: [] for arm in arms}
            for round_ in range(repeats):  # interleaved: every arm once per round
                for arm in arms:
                    if arm.arm.startswith("llama-server") and round_ >= (args.llama_rounds or repeats):
                        continue
                    runs[arm.arm].append(arm(batch, args.new_tokens, streams))
            row = {"scenario": scenario, "streams": streams, "requests": len(batch), "repeats": repeats}
            for name, results in runs.items():
                if not results:
                    continue
                row[name] = {"tok_s": statistics.median(r["tok_s"] for r in results),
                             "runs_tok_s": [r["tok_s"] for r in results],
                             **{k: results[-1].get(k) for k in ("acceptance", "tokens_per_step") if k in results[-1]}}
            row["gate"] = gate(runs["tokenloop off"], runs["tokenloop ngram"])
            rows.append(row)
    names = [arm.arm for arm in arms]
    figures = {"new_tokens": args.new_tokens, "weights": args.weights, "repeats": args.repeats, "rows": rows}

    def table() -> str:
        head = "| scenario | streams | " + " | ".join(f"{n} tok/s" for n in names) + \
            " | ngram / off | paired ratios: median (min-max), drafted tokens | gate (chat >= 0.97x) |"
        lines = [head, "|" + " --- |" * (len(names) + 5)]
        for row in rows:
            cells = []
            for n in names:
                if n not in row:
                    cells.append("—")
                    continue
                cell = f"{row[n]['tok_s']:.1f}"
                if row[n].get("acceptance"):
                    cell += f" (acc {row[n]['acceptance']:.2f}"
                    cell += f", {row[n]['tokens_per_step']:.2f}/step)" if row[n].get("tokens_per_step") else ")"
                cells.append(cell)
            ratio = row["tokenloop ngram"]["tok_s"] / row["tokenloop off"]["tok_s"]
            g = row["gate"]
            paired = f"{g['median_ratio']:.3f} ({g['spread'][0]:.3f}-{g['spread'][1]:.3f}), {g['draft_tokens']}"
            verdict = g["verdict"] if row["scenario"] == "chat" else "—"
            lines.append(f"| {row['scenario']} | {row['streams']} | " + " | ".join(cells) +
                         f" | {ratio:.2f}x | {paired} | {verdict} |")
        return "\n".join(lines)

    return report(args, figures, table)


if __name__ == "__main__":
    raise SystemExit(main())
