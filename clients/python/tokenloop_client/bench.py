"""Load generator behind `tokenloop-cli bench`: N concurrent streams, client-side TTFT and ITL."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from .aio import AsyncClient
from .errors import TokenloopError

_BASE_TEXT = (
    "The looper thread drains the channel, submits new requests to the executor, polls it for "
    "token steps and fans each step back to the right stream. Continuous batching keeps every "
    "slot of the batch busy while requests come and go at their own pace. "
)


@dataclass(frozen=True)
class BenchConfig:
    """One load level: how many streams at once, how many requests or how long, what shape."""

    concurrency: int = 1
    num_requests: int | None = 32
    duration_s: float | None = None
    prompt_tokens: int = 64
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True
    loras: tuple[str, ...] = ()  # LoRA adapters the requests name in turn ("" = the base model); () = base only

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests, duration_s, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("prompt_tokens and max_new_tokens must be >= 1")


@dataclass
class RequestRecord:
    """What one request measured, from the client's side."""

    code: str = "OK"
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p95 / p99 and mean of values (linear interpolation); None when empty."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


async def make_prompts(client: AsyncClient, num_tokens: int, num_prompts: int) -> list[list[int]]:
    """Prompts of exactly num_tokens ids each, every one starting at a different offset."""
    base = list((await client.tokenize(_BASE_TEXT)).token_ids)
    if not base:
        raise ValueError("the server tokenized the benchmark prompt to nothing")
    while len(base) < num_tokens + num_prompts:
        base = base + base
    return [base[i:i + num_tokens] for i in range(num_prompts)]


async def one_request(client: AsyncClient, ids: list[int], cfg: BenchConfig, lora: str = "") -> RequestRecord:
    """Stream one completion and time it."""
    rec = RequestRecord(prompt_tokens=len(ids))
    start = last = time.perf_counter()
    stream = client.stream(token_ids=ids, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, ignore_eos=cfg.ignore_eos, lora=lora)
    try:
        async for delta in stream:
            now = time.perf_counter()
            num_tokens = max(1, len(delta.token_ids))
            if rec.ttft_s is None:
                rec.ttft_s = now - start
            else:
                rec.itl_s.extend([(now - last) / num_tokens] * num_tokens)
            last = now
        rec.output_tokens = stream.result.usage.completion_tokens
    except TokenloopError as err:
        rec.code = err.code.name
    rec.latency_s = time.perf_counter() - start
    return rec


class Progress:
    """Progress of one level on stderr: a bar redrawn in place on a terminal ("bar"), a line every LINE_EVERY_S
    seconds otherwise ("lines", for logs and CI), or nothing ("off")."""

    LINE_EVERY_S = 5.0

    def __init__(self, cfg: BenchConfig, mode: str | bool) -> None:
        self.cfg = cfg
        self.mode = {True: "bar", False: "off"}.get(mode, mode)
        if self.mode not in ("bar", "lines", "off"):
            raise ValueError(f"progress mode must be 'bar', 'lines' or 'off'; got {mode!r}")
        self.start = time.perf_counter()
        self.records: list[RequestRecord] = []

    def fraction(self) -> float:
        """How far the level is, 0 to 1."""
        parts = []
        if self.cfg.num_requests:
            parts.append(len(self.records) / self.cfg.num_requests)
        if self.cfg.duration_s:
            parts.append((time.perf_counter() - self.start) / self.cfg.duration_s)
        return min(1.0, max(parts))

    def status(self) -> str:
        """Requests done, output tokens per second, errors, seconds so far (and of how many)."""
        elapsed = time.perf_counter() - self.start
        num_tokens = sum(r.output_tokens for r in self.records)
        num_errors = sum(r.code != "OK" for r in self.records)
        of = f" of {self.cfg.duration_s:g}s" if self.cfg.duration_s else ""
        return (f"{len(self.records):>4} req  {num_tokens / max(elapsed, 1e-9):7.1f} tok/s  {num_errors} err  "
                f"{elapsed:6.1f}s{of}")

    def draw(self, final: bool = False) -> None:
        """Redraw the bar, or write a line."""
        if self.mode == "bar":
            width = 24
            done = int(self.fraction() * width)
            sys.stderr.write(f"\rconcurrency {self.cfg.concurrency:>3} [{'#' * done}{'.' * (width - done)}] "
                             f"{self.status()}" + ("\n" if final else ""))
        elif self.mode == "lines":
            sys.stderr.write(f"concurrency {self.cfg.concurrency:>3} {'done   ' if final else 'running'} "
                             f"{self.status()}\n")
        sys.stderr.flush()

    async def run(self) -> None:
        """Redraw every quarter second (a bar) or write a line every LINE_EVERY_S seconds until cancelled."""
        every = 0.25 if self.mode == "bar" else self.LINE_EVERY_S
        while True:
            await asyncio.sleep(every)
            self.draw()


async def run_level(client: AsyncClient, cfg: BenchConfig, show_progress: bool | str = False) -> dict:
    """Run one load level and return its summary; show_progress: a Progress mode ("bar", "lines", "off")."""
    num_prompts = min(cfg.num_requests or 256, 256)
    prompts = await make_prompts(client, cfg.prompt_tokens, num_prompts)
    progress = Progress(cfg, show_progress)
    deadline = progress.start + cfg.duration_s if cfg.duration_s else None
    num_started = 0

    async def worker() -> None:
        nonlocal num_started
        while cfg.num_requests is None or num_started < cfg.num_requests:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            ids = prompts[num_started % len(prompts)]
            lora = cfg.loras[num_started % len(cfg.loras)] if cfg.loras else ""
            num_started += 1
            progress.records.append(await one_request(client, ids, cfg, lora))

    drawer = asyncio.ensure_future(progress.run())
    try:
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    finally:
        drawer.cancel()
    elapsed = time.perf_counter() - progress.start
    progress.draw(final=True)
    return summarize(cfg, progress.records, elapsed)


def summarize(cfg: BenchConfig, records: list[RequestRecord], elapsed_s: float) -> dict:
    """Throughput, latency percentiles and errors by status code for one level."""
    ok = [r for r in records if r.code == "OK"]
    num_out = sum(r.output_tokens for r in ok)
    num_prompt = sum(r.prompt_tokens for r in ok)
    return {
        "config": asdict(cfg),
        "concurrency": cfg.concurrency,
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors_by_code": dict(Counter(r.code for r in records if r.code != "OK")),
        "duration_s": elapsed_s,
        "requests_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
        "output_tokens": num_out,
        "output_tokens_per_s": num_out / elapsed_s if elapsed_s else 0.0,
        "total_tokens_per_s": (num_out + num_prompt) / elapsed_s if elapsed_s else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "latency_s": percentiles([r.latency_s for r in ok]),
    }
