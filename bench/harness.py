"""The bench harness: what every benchmark shares, so that each benchmark is only its workload and its table.

- ports and servers: `free_port`, `tokenloop_command`, `TokenloopServer` (a `tokenloop serve` child on a free port,
  ready once `wait_ready` sees its health service SERVING);
- clients, both asyncio in this process: `stream_generate` (tokenloop.v1 Generate, greedy, EOS ignored, `concurrency`
  in flight) and `sse_lines` (an HTTP POST whose Server-Sent Events are read line by line: llama-server's and the
  OpenAI-style streaming APIs), so that neither side's client costs more than the other's;
- CPU and machine: `/proc` readers (`proc_cpu_s`, `threads_cpu_s`, `cpu_by_thread_name`), `CpuMeter` (the server's
  CPU by thread, this client's and the rest of the machine's over one measured run, kept in the results file), and
  `machine()` / `describe()` / `write()`: a results file is written only when `--out FILE` asks, stamped with the
  date, the CPU record and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenloop_client.machine import cpu_record

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A long text to cut prompts from: the README and a few paragraphs, tokenized once by each benchmark.
TEXT = ((ROOT / "README.md").read_text() if (ROOT / "README.md").is_file() else "") + " ".join([
    "The history of computing is a story of ideas that became machines and machines that changed ideas.",
    "Rivers carve valleys over millions of years, and the shapes they leave tell geologists about climate.",
    "A good recipe lists its ingredients in the order they are used and says what the dough should feel like.",
    "In distributed systems every timeout is a guess about the future, and every retry is a bet on it.",
]) * 60


# --- ports and servers ---

def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tokenloop_command() -> list[str]:
    """`tokenloop` as installed beside this Python (the virtualenv's), else as a module of this Python."""
    script = Path(sys.executable).with_name("tokenloop")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tokenloop.service.cli"]


async def wait_ready(port: int | str, timeout: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    """Until the server on `port` (of loopback, or a HOST:PORT) reports SERVING on its health service; fails at
    once if `proc` exits first."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(port if isinstance(port, str) else f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server on port {port} exited with {proc.returncode} before it was ready")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.3)
    raise TimeoutError(f"the server on port {port} did not become ready in {timeout:.0f} s")


class TokenloopServer:
    """`tokenloop serve --model MODEL FLAGS` on a free port for the length of a `with` block, ready when entered."""

    def __init__(self, model: str | Path, flags: list[str] = (), env: dict | None = None,
                 log_level: str | None = None, timeout: float = 300.0, stderr=None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cmd = [*tokenloop_command(), "serve", "--model", str(model), "--host", "127.0.0.1", "--port",
                    str(self.port), "--metrics-port", "0",
                    "--log-level", log_level or os.environ.get("BENCH_LOG_LEVEL", "WARNING"), *flags]
        self.env, self.timeout, self.proc, self.stderr = env, timeout, None, stderr  # stderr: a file, else ours

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> TokenloopServer:
        asyncio.run(self.start())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> TokenloopServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop()

    async def start(self) -> None:
        """Start it and wait until it serves (stopped again if it does not)."""
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     env={**os.environ, **(self.env or {})})
        try:
            await wait_ready(self.port, self.timeout, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> int:
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM, then SIGKILL after `timeout` seconds: the exit status."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# --- clients ---

@dataclass
class StreamRun:
    """What a batch of streams did: wall seconds, and per request (in completion order) its TTFT, tokens, the
    prompt tokens its server took from a cache, its finish reason and the tokens speculation drafted for it."""

    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    cached_prompt_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)


async def stream_generate(port: int, prompts: list[list[int]], num_new: list[int], concurrency: int,
                          json_schema: str | None = None) -> StreamRun:
    """Greedy streaming tokenloop.v1 Generate calls on one channel, `concurrency` in flight; EOS ignored unless a
    JSON schema constrains them."""
    import grpc

    from tokenloop.v1 import tokenloop_pb2 as pb
    from tokenloop.v1 import tokenloop_pb2_grpc

    gate, run = asyncio.Semaphore(concurrency), StreamRun(0.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tokenloop_pb2_grpc.TextGenerationStub(channel)

        async def one(prompt: list[int], n: int) -> None:
            async with gate:
                sent, first, count = time.perf_counter(), None, 0
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt), stream=True, sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=json_schema is None))
                if json_schema is not None:
                    request.json_schema = json_schema
                async for response in stub.Generate(request):
                    if response.HasField("chunk") and response.chunk.token_ids:
                        first = first or time.perf_counter()
                        count += len(response.chunk.token_ids)
                    elif response.HasField("complete"):
                        run.cached_prompt_tokens.append(response.complete.usage.cached_prompt_tokens)
                        run.finish_reasons.append(pb.FinishReason.Name(response.complete.finish_reason))
                        run.draft_tokens.append(response.complete.usage.draft_tokens)
                run.ttft_s.append(first - sent if first else float("nan"))
                run.num_tokens.append(count)

        start = time.perf_counter()
        await asyncio.gather(*(one(p, n) for p, n in zip(prompts, num_new)))
        run.wall_s = time.perf_counter() - start
    return run


@contextlib.asynccontextmanager
async def never_reading(target: str, requests: list, num_channels: int, options: list[tuple[str, int]]):
    """Generate calls of tokenloop.v1 over `num_channels` connections with `options` (a tiny HTTP/2 window: no BDP
    probe, a small lookahead), each read once at most and then never, so the server's writes to them stop. Yields
    the calls; cancels them and closes the connections on the way out."""
    import grpc

    from tokenloop.v1 import tokenloop_pb2_grpc

    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(num_channels)]
    calls = [tokenloop_pb2_grpc.TextGenerationStub(channels[i % num_channels]).Generate(request)
             for i, request in enumerate(requests)]
    first_reads = [asyncio.ensure_future(c.read()) for c in calls]
    try:
        yield calls
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*first_reads, return_exceptions=True)
        for channel in channels:
            await channel.close()


class HttpError(RuntimeError):
    """An HTTP server answered with a status other than 200."""


async def sse_lines(host: str, port: int, path: str, body: dict, timeout: float = 600.0) -> AsyncIterator[bytes]:
    """POST `body` as JSON to http://host:port/path on asyncio streams (HTTP/1.1, one connection) and yield each
    line of the answer's body as it arrives (chunked transfer encoding undone): one Server-Sent Event per `data:`
    line. The standard library has no asyncio HTTP client; this is the part a streaming benchmark needs."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), timeout)).split()
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != b"200":
            raise HttpError(f"POST {path}: HTTP {b' '.join(status[1:]).decode()}: {(await reader.read(500))!r}")
        if headers.get("transfer-encoding", "").lower() != "chunked":
            while line := await asyncio.wait_for(reader.readline(), timeout):
                yield line
            return
        pending = b""
        while size := int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0].strip() or b"0", 16):
            pending += await asyncio.wait_for(reader.readexactly(size + 2), timeout)  # the chunk and its CRLF
            pending = pending[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
        if pending:
            yield pending
    finally:
        writer.close()


# --- CPU and machine ---

def stat_cpu_s(stat_path: str | Path) -> float:
    """utime + stime from a /proc stat file (a process's or a thread's), in seconds (resolution 1 / CLK_TCK)."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_s(pid: int | str = "self") -> float:
    """utime + stime of a whole process (every thread), in seconds."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def threads_cpu_s(pid: int | str = "self") -> dict[int, float]:
    """Seconds on a CPU of each live thread of a process, by thread id (schedstat: nanosecond resolution)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended while we read
    return out


def thread_names(pid: int | str = "self") -> dict[int, str]:
    """The OS-level name (comm) of each live thread of a process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def cpu_by_thread_name(pid: int) -> dict[str, float]:
    """CPU seconds of the threads of `pid`, summed by thread name."""
    names, out = thread_names(pid), {}
    for tid, seconds in threads_cpu_s(pid).items():
        name = names.get(tid, str(tid))
        out[name] = out.get(name, 0.0) + seconds
    return out


class CpuMeter:
    """CPU seconds over a `with` block: the server's by thread (when its pid is known), this client process's, and
    everything else on the machine (the load note every figure needs). `record` is what a results file keeps."""

    def __init__(self, name: str, server_pid: int | None = None):
        self.name, self.pid, self.record = name, server_pid, {}

    def __enter__(self) -> CpuMeter:
        from tokenloop.engine.calibration import machine_busy_s  # torch: only a benchmark that meters imports it

        self._server = cpu_by_thread_name(self.pid) if self.pid else {}
        self._client, self._busy = time.process_time(), machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        from tokenloop.engine.calibration import machine_busy_s

        after = cpu_by_thread_name(self.pid) if self.pid else {}
        client, busy = time.process_time() - self._client, machine_busy_s() - self._busy
        server = {t: round(after[t] - self._server.get(t, 0.0), 3) for t in after}
        self.record = {"server_cpu_s": round(sum(server.values()), 3), "client_cpu_s": round(client, 3),
                       "other_cpu_s": round(busy - sum(server.values()) - client, 3),
                       "server_cpu_s_by_thread": {t: s for t, s in server.items() if s >= 0.05}}
        busiest = sorted(self.record["server_cpu_s_by_thread"].items(), key=lambda kv: -kv[1])[:8]
        print(f"{self.name}: server CPU s by thread: " + (", ".join(f"{n} {t:.2f}" for n, t in busiest) or
                                                          "(not known)")
              + f"; bench client {client:.1f}; everything else on the machine {self.record['other_cpu_s']:.1f}",
              file=sys.stderr, flush=True)


def commit(root: Path = ROOT) -> str:
    """The commit of the checkout at `root` (this one by default; with `+dirty` when its tree has changes), or
    "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        return (sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    """The date and the machine a run was on: the CPU (cpu_record), CPUs, OS, and the commit."""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **cpu_record(), "cpus": os.cpu_count(),
            "machine": platform.platform(), "commit": commit()}


def describe(record: dict) -> str:
    """One line for a table: 'AMD EPYC (family 25 model 17; avx2 fma ... avx512_bf16)', as bench/RESULTS*.md say it."""
    where = f"family {record.get('cpu_family')} model {record.get('cpu_model')}"
    return f"{record['cpu']} ({where}; {' '.join(record.get('isa') or ['no flags recorded'])})"


def add_out_argument(parser: argparse.ArgumentParser, current: str) -> None:
    """`--out FILE`; `current` names the file that holds the recorded figures (for the help text)."""
    parser.add_argument("--out", default=None, metavar="FILE",
                        help=f"write the figures as JSON to FILE (none by default; recorded runs go to bench/{current})")


def command() -> str:
    """The command line of this run, as a reader would type it again: `tokenloop-bench NAME ARGS` (set by the
    runner, bench/__main__.py) or `python -m tokenloop.bench.MODULE ARGS`."""
    if COMMAND:
        return " ".join(COMMAND)
    return " ".join(["python -m tokenloop.bench." + Path(sys.argv[0]).stem, *sys.argv[1:]])


COMMAND: list[str] = []  # `tokenloop-bench NAME ARGS...` when the runner started this benchmark


def write(path: str | None, figures: dict) -> None:
    """Write `figures` to `path` with the date, machine, commit and command of the run (unless they carry them);
    nothing when `path` is None. No benchmark writes a file unless asked, so a run never leaves a new file to commit
    by accident; each benchmark's current figures are one file, earlier runs are in git."""
    if path:
        Path(path).write_text(json.dumps({**machine(), "command": command(), **figures}, indent=1) + "\n")
        print(f"wrote {path}")


def parser(doc: str, results: str) -> argparse.ArgumentParser:
    """A benchmark's command line with what such benchmarks share: --model, --json (only the JSON line) and --out."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    add_out_argument(p, results)
    return p


def report(args: argparse.Namespace, figures: dict, table: Callable[[], str]) -> int:
    """How a benchmark with `--json` ends: its figures to `--out`, its table unless `--json`, then one JSON line."""
    write(args.out, figures)
    if not args.json:
        print(table() + "\n")
    print(json.dumps(figures))
    return 0
