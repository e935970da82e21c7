"""Long prompts and everyone else's tokens: does tokenizing one request's prompt stall the other streams?

    .venv/bin/tokenloop-bench prompt_stall            # table + JSON line (about a minute)
    .venv/bin/tokenloop-bench prompt_stall --json     # only the JSON line

Two servers, each its own process (`bench/service_overhead.py serve full`: the real server on the null executor
pacing --rate tokens/s per stream, and the real tokenizer of --model):

- offloaded: the default `--tokenize-inline-chars 2048`: a longer text is tokenized on a tokenizer thread, with
  the GIL released (`App.tokenizing`);
- inline: `--tokenize-inline-chars` past any prompt: every text tokenized on the event loop, as before.

Per server, interleaved, --repeat times: --streams paced streams for --seconds while another client sends
Generate requests with a prompt of --prompt-tokens tokens (max_new_tokens 1), one at a time, --prompts-per-s a
second; on the offloaded server also a quiet run without them. Reported: the paced tokens' latency from their
emission in the executor to their receipt here (p50 / p99 / max, the run with the median p99 kept), and the long
requests' own time to their answer (p50).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import grpc

from tokenloop.bench import service_overhead as so
from tokenloop.bench.harness import parser, report
from tokenloop.bench.null_executor import SAMPLE_TEXT
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

INLINE_ALWAYS = 1 << 30  # --tokenize-inline-chars past any message


def long_prompt(model: str, num_tokens: int) -> tuple[str, int]:
    """Mixed text (accents, CJK, emoji) cut to about `num_tokens` tokens of `model`'s tokenizer: (text, tokens)."""
    from tokenloop.core.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model)
    per = max(1, len(SAMPLE_TEXT) // len(tok.encode(SAMPLE_TEXT)))
    text = SAMPLE_TEXT * (num_tokens * per // len(SAMPLE_TEXT) + 2)
    text = text[:num_tokens * per]
    while len(tok.encode(text)) > num_tokens:
        text = text[:int(len(text) * 0.95)]
    return text, len(tok.encode(text))


async def send_prompts(port: int, text: str, per_s: float, stop: asyncio.Event) -> list[float]:
    """Generate requests with `text`, one at a time, at most `per_s` a second, until `stop`: each one's seconds."""
    took = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        request = pb.GenerateRequest(text=text, stopping=pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True))
        while not stop.is_set():
            t0 = time.monotonic()
            async for _ in stub.Generate(request):
                pass
            took.append(time.monotonic() - t0)
            await asyncio.sleep(max(0.0, 1.0 / per_s - (time.monotonic() - t0)))
    return took


async def one_run(srv, args, text: str | None, tag: str) -> dict:
    stop = asyncio.Event()
    sender = asyncio.ensure_future(send_prompts(srv.port, text, args.prompts_per_s, stop)) if text else None
    try:
        row = await so.run_load(srv.port, args.streams, int(args.seconds * args.rate), tag, srv.proc.pid,
                                srv.looper_tid, 0.0, 1.0 / args.rate)
    finally:
        stop.set()
        took = await sender if sender else []
    row["prompts"] = len(took)
    if took:
        row["prompt_ms_p50"] = 1e3 * statistics.median(took)
    return row


async def measure(args) -> dict:
    text, num_tokens = long_prompt(args.model, args.prompt_tokens)
    servers = {"offloaded": so.ServerProcess("full", args.model, rate=args.rate),
               "inline": so.ServerProcess("full", args.model, rate=args.rate, tokenize_inline_chars=INLINE_ALWAYS)}
    runs: dict[str, list[dict]] = {"quiet": [], "offloaded": [], "inline": []}
    try:
        for rep in range(args.repeat):
            for name in ("quiet", "offloaded", "inline"):
                srv = servers["offloaded" if name == "quiet" else name]
                runs[name].append(await one_run(srv, args, None if name == "quiet" else text, f"{name}{rep}"))
    finally:
        stamps = {name: srv.stop() for name, srv in servers.items()}
    out = {"prompt_tokens": num_tokens, "prompt_chars": len(text)}
    for name, rows in runs.items():
        for r in rows:
            so.add_latency(r, stamps["offloaded" if name == "quiet" else name])
        r = sorted(rows, key=lambda r: r["latency_p99_ms"])[(len(rows) - 1) // 2]  # the median p99's run
        out.update({f"{name}_p50_ms": round(r["latency_p50_ms"], 3), f"{name}_p99_ms": round(r["latency_p99_ms"], 3),
                    f"{name}_max_ms": round(r["latency_max_ms"], 3)})
        if name != "quiet":
            out[f"{name}_prompts"] = sum(x["prompts"] for x in rows)
            out[f"{name}_prompt_ms_p50"] = round(statistics.median(x["prompt_ms_p50"] for x in rows), 3)
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "results-prompt-stall.json")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per paced stream")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    p.add_argument("--prompt-tokens", type=int, default=8000, help="tokens of each long prompt")
    p.add_argument("--prompts-per-s", type=float, default=8.0)
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs per server; the median p99's is kept")
    args = p.parse_args(argv)
    import uvloop
    out = uvloop.run(measure(args))
    return report(args, out, lambda: "\n".join([
        f"{args.streams} streams at {args.rate:g} tokens/s; long prompts of {out['prompt_tokens']} tokens "
        f"({out['prompt_chars']} characters), {args.prompts_per_s:g}/s\n",
        "| run | paced tokens p50 / p99 / max ms | long prompts sent | a long request's time p50 ms |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {out[f'{name}_p50_ms']:.2f} / {out[f'{name}_p99_ms']:.2f} / {out[f'{name}_max_ms']:.2f} "
          f"| {out.get(f'{name}_prompts', 0)} | {out.get(f'{name}_prompt_ms_p50', float('nan')):.1f} |"
          for name in ("quiet", "offloaded", "inline"))]))


if __name__ == "__main__":
    sys.exit(main())
