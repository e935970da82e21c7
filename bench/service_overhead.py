"""What the Python front costs: a bare grpc.aio stream vs the full tokenloop path on a null executor.

    .venv/bin/tokenloop-bench service_overhead            # the table (about 3.5 minutes)
    .venv/bin/tokenloop-bench service_overhead --json     # one JSON line, with ratio_256 and token_ratio_256
    .venv/bin/tokenloop-bench service_overhead --ab-checkout ../main --streams 256 --ab-rounds 8
                                                          # A/B: this checkout's front against another's

Every server runs in its own process (started from this file with `serve ...`); this process is the
client (grpc.aio on uvloop, one channel). Scenarios, each at 1, 64 and 256 concurrent streams:

- bare: a grpc.aio server-streaming method that yields one pre-built ~20-byte message per token
  (the ceiling for Python gRPC on this machine);
- messages: the full path (validation, admission, channel, looper, detokenizer, fan-out,
  protobuf) on the null executor emitting as fast as it is polled, one token per message
  (coalescing off);
- coalesced: the same with coalescing on (`--stream-interval 1`): a reader that falls behind gets
  all ready tokens of its request in one message;
- paced: the null executor at 20 tokens/s per stream; the added latency of each token from its
  emission in the executor (CLOCK_MONOTONIC, shared by both processes) to its receipt here;
- bare-paced: the bare method sending at the same pace; the latency of each message from its send
  (the gRPC hop alone) and, "from due", from when its timer was due (the hop plus the server's
  own timer wake-up, which the full path's figure includes through the executor's wait);
- router, router-paced: coalesced and paced through `trtllm.TrtllmService` Generate, the API the
  Shepherd Model Gateway routes to (token ids in; it always coalesces what is ready per read).

Throughput scenarios keep the best of `--repeat` interleaved runs; paced ones run `--paced-repeat`
times, interleaved, and keep the run with the median p50 (a VM's wake-up latency drifts).

Then `bench/idle_cpu.py` measures an idle server over 10 s.

`--ab-checkout DIR` compares two fronts instead, in one sitting: DIR is another checkout (a `git worktree` at the
other commit, with its own `.venv` from `make setup`) whose full server runs with DIR's code. Every round runs
bare, A (this checkout) and B (DIR) one after another at each `--streams` count, the order of A and B swapped every
other round, so that load from elsewhere lands on both alike; each arm's ratio is its tokens/s over the same
round's bare messages/s, and the figures are the medians over `--ab-rounds` rounds (with every round kept), with
their quartiles and, as a second estimate, each arm's mean rate over bare's mean rate. One run's rate varies by ~15 %
(its coefficient of variation on the 2-vCPU VM, 2026-12-07) from run to run of the same code, so the median of 8
rounds is known to about ±7 % and of 24 (the default) to about ±4 %.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tokenloop.bench.harness import DEFAULT_MODEL, ROOT, add_out_argument, commit, proc_cpu_s, threads_cpu_s, write
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

PROMPT = "Write a short story about a looper thread that never spins."
ROUTER_PROMPT_IDS = list(range(100, 112))  # the router API takes token ids: 12 of them, valid in any vocabulary
CONCURRENCY = (1, 64, 256)


def tokens_per_stream(num_streams: int, total: int) -> int:
    return max(128, min(4096, total // num_streams))


# -- the server processes ------------------------------------------------------------------
class BareServicer(pb_grpc.TextGenerationServicer):
    """Yields max_new_tokens pre-built one-token chunks: the ceiling of grpc.aio streaming here."""

    async def Generate(self, request, context):
        msg = pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(index=0, text=" token",
                                                                             token_ids=[1234]))
        rate = float(dict(context.invocation_metadata() or ()).get("x-bench-rate", 0))
        if rate:  # paced: one message every 1/rate s; its send and due times (CLOCK_MONOTONIC) in `text`
            async for m in self._paced(msg, request.stopping.max_new_tokens, rate):
                yield m
            return
        for _ in range(request.stopping.max_new_tokens):
            yield msg

    @staticmethod
    async def _paced(msg, num: int, rate: float):
        start = time.monotonic()
        for k in range(num):
            due = start + (k + 1) / rate
            while (delay := due - time.monotonic()) > 0:  # libuv's millisecond timers may fire early
                await asyncio.sleep(delay)
            msg.chunk.text = f"{time.monotonic():.6f} {due:.6f}"
            yield msg


async def _serve_bare(args) -> tuple[object, object]:
    from tokenloop.service.config import ServerConfig
    from tokenloop.service.server import grpc_options
    server = grpc.aio.server(options=grpc_options(ServerConfig()))
    pb_grpc.add_TextGenerationServicer_to_server(BareServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return port, lambda: server.stop(0)


def _install_trace(ex) -> None:
    """BENCH_TRACE=1 (diagnosis): at exit, print where the added latency goes, token by token: the time from
    its emission (due time) to the executor's return of it (the looper thread awake), to the looper's hand-off
    running on the event loop (`Outbox.deliver`) and to the servicer's `StreamWriter.encode`; each as p50 from
    emission and p50 / p90 of the hop alone; and how many polls and hand-offs carried them. It wraps public
    methods only: the executor's, `Outbox.deliver` and `StreamWriter.encode`."""
    import atexit

    from tokenloop.looper.outputs import Outbox
    from tokenloop.looper.stream import Chunk, as_chunk
    from tokenloop.service.convert import StreamWriter
    hops = ("executor", "hand-off", "writer")
    times: dict[tuple[str, int], list[float]] = {}  # (request id, token index) -> time at each hop
    seen: dict[tuple[str, str], int] = {}

    def note(where: str, rid: str, events, now: float) -> None:
        k = seen.get((where, rid), 0)
        for e in map(as_chunk, events):
            for _ in e.token_ids if type(e) is Chunk else ():
                times.setdefault((rid, k), []).append(now)
                k += 1
        seen[(where, rid)] = k

    deliver, encode, enqueue, await_responses = Outbox.deliver, StreamWriter.encode, ex.enqueue, ex.await_responses
    count = {"polls": 0, "hand-offs": 0}
    names: dict[int, str] = {}  # executor id -> request id (the executor forgets it at the final step)

    def traced_enqueue(request):
        names[eid := enqueue(request)] = request.request_id
        return eid

    def traced_await(timeout):
        steps, t = await_responses(timeout), time.monotonic()
        count["polls"] += 1
        for step in steps:
            if step.seq_index == 0 and step.token_ids:
                rid = names[step.executor_id]
                first = seen.get(("executor", rid), 0)
                for k in range(first, first + len(step.token_ids)):
                    times[(rid, k)] = [ex.emitted[rid][k], t]
                seen[("executor", rid)] = first + len(step.token_ids)
        return steps
    ex.enqueue, ex.await_responses = traced_enqueue, traced_await

    def traced_deliver(outbox):
        count["hand-offs"] += 1
        now = time.monotonic()
        for stream, events in list(outbox.events.items()):
            note("hand-off", stream.request.request_id, events, now)
        return deliver(outbox)

    def traced_encode(self, batch):
        note("writer", self.request.request_id, batch, time.monotonic())
        return encode(self, batch)
    Outbox.deliver, StreamWriter.encode = traced_deliver, traced_encode

    def report() -> None:
        rows = [t for t in times.values() if len(t) == len(hops) + 1]
        if not rows:
            return
        out = []
        for i, hop in enumerate(hops, 1):
            total = statistics.median(t[i] - t[0] for t in rows)
            alone = statistics.quantiles([t[i] - t[i - 1] for t in rows], n=10)
            out.append(f"{hop} {1e3 * total:.2f} ms (hop p50 {1e3 * alone[4]:.3f} / p90 {1e3 * alone[8]:.3f})")
        print(f"TRACE {len(rows)} tokens, {count['polls']} polls, {count['hand-offs']} hand-offs; emission -> "
              + ", ".join(out), file=sys.stderr)
    atexit.register(report)


async def _serve_full(args) -> tuple[object, object]:
    from tokenloop.bench.null_executor import NullExecutor, sample_token_ids
    from tokenloop.core.tokenizer import Tokenizer
    from tokenloop.service.config import ServerConfig
    from tokenloop.service.server import Server
    ex = NullExecutor(sample_token_ids(Tokenizer.from_dir(args.model)), rate=args.rate, record=True)
    fields = dict(model=args.model, port=0, max_concurrent_requests=4096, max_queue=4096,
                  max_new_tokens=1 << 16, stall_timeout=60.0)
    fields["stream_interval"] = args.stream_interval
    fields["coalesce"] = not args.no_coalesce
    if args.tokenize_inline_chars is not None:
        fields["tokenize_inline_chars"] = args.tokenize_inline_chars
    if args.front_cpu is not None:
        fields["front_cpu"] = args.front_cpu
    if os.environ.get("BENCH_TRACE"):
        _install_trace(ex)
    server = Server(ServerConfig(**fields), executor_factory=lambda cfg: ex)
    port = await server.start()
    print(f"LOOPER {server.app.looper.thread_id}", flush=True)

    async def stop():
        Path(args.record).write_text(json.dumps(ex.emitted))
        await server.stop(grace=0)
    return port, stop


async def serve(args) -> None:
    """Run one server until SIGTERM; prints `READY <port>` when it serves."""
    port, stop = await (_serve_bare(args) if args.mode == "bare" else _serve_full(args))
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    print(f"READY {port}", flush=True)
    await done.wait()
    await stop()


def serve_command(checkout: Path | None = None) -> list[str]:
    """This file's `serve` in a process of its own: this checkout's, or another checkout's with its own virtualenv
    (older checkouts ran bench/ as scripts)."""
    if checkout is None:
        return [sys.executable, "-m", "tokenloop.bench.service_overhead", "serve"]
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: run `make setup` in {checkout}")
    if (checkout / "bench" / "__init__.py").exists():
        return [str(python), "-m", "tokenloop.bench.service_overhead", "serve"]
    return [str(python), str(checkout / "bench" / "service_overhead.py"), "serve"]


class ServerProcess:
    """A `serve` child process; `stop()` returns the executor's emission stamps (full mode)."""

    def __init__(self, mode: str, model: str, rate: float | None = None, no_coalesce: bool = False,
                 stream_interval: int = 1, tokenize_inline_chars: int | None = None, front_cpu: str | None = None,
                 checkout: Path | None = None):
        self.record = tempfile.mktemp(suffix=".json")
        cmd = [*serve_command(checkout), mode, "--model", model, "--record", self.record,
               "--stream-interval", str(stream_interval)]
        cmd += ["--rate", str(rate)] if rate else []
        cmd += ["--no-coalesce"] if no_coalesce else []
        cmd += ["--tokenize-inline-chars", str(tokenize_inline_chars)] if tokenize_inline_chars is not None else []
        cmd += ["--front-cpu", front_cpu] if front_cpu is not None and mode == "full" else []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=checkout or ROOT)
        line = self.proc.stdout.readline()
        looper = int(line.split()[1]) if line.startswith("LOOPER") else 0
        if looper:
            line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.looper_tid = looper

    def stop(self) -> dict[str, list[float]]:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        path = Path(self.record)
        stamps = json.loads(path.read_text()) if path.exists() else {}
        path.unlink(missing_ok=True)
        return stamps


# -- the client ----------------------------------------------------------------------------
async def _one_stream(stub, rid: str, num_tokens: int, receipts: list, rate: float = 0.0,
                      delay: float = 0.0) -> tuple[int, int]:
    if delay:
        await asyncio.sleep(delay)
    call = stub.Generate(pb.GenerateRequest(
        request_id=rid, text=PROMPT, stream=True,
        stopping=pb.StoppingCriteria(max_new_tokens=num_tokens, ignore_eos=True)),
        metadata=(("x-bench-rate", str(rate)),) if rate else None)
    return await _read(call, receipts, with_text=bool(rate))


async def _read(call, receipts: list, with_text: bool = False) -> tuple[int, int]:
    """Read a Generate stream of either API to its end: (tokens, messages); a receipt per message with tokens,
    `(time, n)`, or `(time, n, text)` with `with_text` (the bare paced server's send and due times)."""
    num_tok = num_msg = 0
    mono = time.monotonic
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return num_tok, num_msg
        n = len(msg.chunk.token_ids)
        if n:
            num_tok += n
            num_msg += 1
            receipts.append((mono(), n, msg.chunk.text) if with_text else (mono(), n))


async def _one_router_stream(stub, rid: str, num_tokens: int, receipts: list, rate: float = 0.0,
                             delay: float = 0.0) -> tuple[int, int]:
    """The same through `trtllm.TrtllmService` Generate, the router API (token ids in, chunks of ids out)."""
    from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
    if delay:
        await asyncio.sleep(delay)
    call = stub.Generate(tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ROUTER_PROMPT_IDS),
                                             max_tokens=num_tokens, streaming=True, request_id=rid))
    return await _read(call, receipts)


async def run_load(port: int, num_streams: int, num_tokens: int, tag: str, server_pid: int,
                   looper_tid: int = 0, rate: float = 0.0, stagger: float = 0.0, router: bool = False) -> dict:
    """`num_streams` concurrent streams of `num_tokens` tokens; throughput, CPU and receipt times. `router`: through
    `trtllm.TrtllmService` Generate instead of `tokenloop.v1`'s."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if router:
            from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc
            stub, one = tpb_grpc.TrtllmServiceStub(channel), _one_router_stream
        else:
            stub, one = pb_grpc.TextGenerationStub(channel), _one_stream
        await asyncio.gather(*(one(stub, f"warm-{tag}-{i}", 8, []) for i in range(8)))
        receipts = {f"{tag}-{i}": [] for i in range(num_streams)}
        th0, cpu0, ccpu0, t0 = threads_cpu_s(server_pid), proc_cpu_s(server_pid), time.process_time(), time.monotonic()
        counts = await asyncio.gather(*(one(stub, rid, num_tokens, r, rate, i * stagger / num_streams)
                                        for i, (rid, r) in enumerate(receipts.items())))
        wall = time.monotonic() - t0
        cpu, ccpu = proc_cpu_s(server_pid) - cpu0, time.process_time() - ccpu0
        th = {t: c - th0.get(t, 0.0) for t, c in threads_cpu_s(server_pid).items()}
    num_tok, num_msg = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if num_tok != num_streams * num_tokens:
        raise RuntimeError(f"{tag}: got {num_tok} tokens, expected {num_streams * num_tokens}")
    return {"streams": num_streams, "tokens": num_tok, "messages": num_msg, "wall_s": wall,
            "tokens_per_s": num_tok / wall, "messages_per_s": num_msg / wall,
            "server_cpu_us_per_msg": 1e6 * cpu / num_msg, "client_cpu_us_per_msg": 1e6 * ccpu / num_msg,
            "server_cpu_pct": 100 * cpu / wall, "looper_cpu_pct": 100 * th.get(looper_tid, 0.0) / wall,
            "server_main_cpu_pct": 100 * th.get(server_pid, 0.0) / wall, "client_cpu_pct": 100 * ccpu / wall,
            "_receipts": receipts}


def _quantiles(lat: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(lat, n=100)
    return 1e3 * q[49], 1e3 * q[98]


def add_latency(result: dict, stamps: dict[str, list[float]]) -> None:
    """Per token: receipt time here minus emission time in the executor (ms, p50 / p99). For the bare server,
    minus its send time (the gRPC hop alone) and, as `due_latency_*`, minus the time its timer was due (the
    hop plus the server's own timer wake-up, which the full path's figure includes)."""
    lat, due_lat = [], []
    for rid, receipts in result.pop("_receipts").items():
        if receipts and len(receipts[0]) == 3:  # the bare server's send and due times, carried in the text
            for t, _, text in receipts:
                sent, due = text.split()
                lat.append(t - float(sent))
                due_lat.append(t - float(due))
            continue
        emitted = stamps.get(rid, [])
        pos = 0
        for t, n in receipts:
            lat += [t - e for e in emitted[pos:pos + n]]
            pos += n
    if lat:
        result["latency_p50_ms"], result["latency_p99_ms"] = _quantiles(lat)
        result["latency_max_ms"] = 1e3 * max(lat)
    if due_lat:
        result["due_latency_p50_ms"], result["due_latency_p99_ms"] = _quantiles(due_lat)


SCENARIOS = {  # name: (server mode, server options); "rate" names the argument that sets it
    "bare": ("bare", {}),
    "bare-paced": ("bare", {"rate": "rate"}),
    "messages": ("full", {"no_coalesce": True}),
    "coalesced": ("full", {"rate": "flood_rate"}),
    "paced": ("full", {"rate": "rate"}),  # streams start spread over one token period
    "paced-burst": ("full", {"rate": "rate"}),  # streams start together: every token of a period at once
    "router": ("full", {"rate": "flood_rate"}),  # as coalesced, through trtllm.TrtllmService (always coalesces)
    "router-paced": ("full", {"rate": "rate"}),  # as paced, through trtllm.TrtllmService
}
ROUTER = ("router", "router-paced")  # scenarios whose client uses the router API


def _pick(name: str, runs: list[dict]) -> dict:
    """Throughput scenarios: the run with the highest throughput (least disturbed by other work on a shared
    machine). Paced scenarios: the run with the median p50 latency, the lower middle one of an even count (their
    throughput is the pace; wake-up latency on a VM drifts between runs), with every run's p50 kept in
    `p50_runs_ms` (and, for bare-paced, every run's p50 from its due time in `due_p50_runs_ms`), both sorted."""
    if "paced" not in name:
        return max(runs, key=lambda r: r["tokens_per_s"])
    runs = sorted(runs, key=lambda r: r.get("latency_p50_ms", float("inf")))
    pick = dict(runs[(len(runs) - 1) // 2])
    pick["p50_runs_ms"] = [round(r["latency_p50_ms"], 3) for r in runs if "latency_p50_ms" in r]
    if "due_latency_p50_ms" in pick:
        pick["due_p50_runs_ms"] = sorted(round(r["due_latency_p50_ms"], 3) for r in runs)
    return pick


async def _measure_all(args, servers: dict) -> dict[str, list[list[dict]]]:
    """Every run: per scenario, per concurrency, a list of runs (interleaved across scenarios)."""
    res: dict[str, list[list[dict]]] = {name: [] for name in servers}
    for n in args.streams:
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for rep in range(max(args.repeat, args.paced_repeat)):  # interleaved: background load hits all alike
            for name, srv in servers.items():
                paced = "paced" in name
                if rep >= (args.paced_repeat if paced else args.repeat):
                    continue
                num = int(3 * args.rate) if paced else tokens_per_stream(
                    n, args.tokens * (8 if name in ("coalesced", "router") else 1))
                stagger = 1.0 / args.rate if name in ("paced", "bare-paced", "router-paced") else 0.0
                runs[name].append(await run_load(srv.port, n, num, f"{name}{n}.{rep}", srv.proc.pid,
                                                 srv.looper_tid, args.rate if name == "bare-paced" else 0.0,
                                                 stagger, router=name in ROUTER))
        for name in servers:
            res[name].append(runs[name])
    return res


def idle_cpu(model: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "tokenloop.bench.idle_cpu", "--model", model,
                          "--executor", "null", "--seconds", str(seconds), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def measure(args) -> dict:
    servers = {}
    try:
        for name, (mode, kw) in SCENARIOS.items():
            if name not in args.scenarios:
                continue
            kw = dict(kw, rate=getattr(args, kw["rate"])) if "rate" in kw else kw
            servers[name] = ServerProcess(mode, args.model, stream_interval=args.stream_interval,
                                          front_cpu=args.front_cpu, **kw)
        res = await _measure_all(args, servers)
    finally:
        stamps = {name: srv.stop() for name, srv in servers.items()}
    for name, per_streams in res.items():
        for runs in per_streams:
            for r in runs:
                add_latency(r, stamps[name])
        res[name] = [_pick(name, runs) for runs in per_streams]
    if args.idle_seconds > 0:
        res["idle"] = idle_cpu(args.model, args.idle_seconds)
    return res


async def measure_ab(args) -> dict:
    """Interleaved A/B of the one-token-per-message path: bare, A (this checkout), B (`--ab-checkout`) per round."""
    checkout = Path(args.ab_checkout).resolve()
    servers = {}
    try:
        servers["bare"] = ServerProcess("bare", args.model)
        servers["A"] = ServerProcess("full", args.model, no_coalesce=True, front_cpu=args.front_cpu)
        servers["B"] = ServerProcess("full", args.model, no_coalesce=True, front_cpu=args.front_cpu,
                                     checkout=checkout)
        rounds: dict[int, list[dict]] = {n: [] for n in args.streams}
        for r in range(args.ab_rounds):
            for n in args.streams:
                num, order = tokens_per_stream(n, args.tokens), ["bare", "A", "B"] if r % 2 == 0 else ["bare", "B", "A"]
                runs = {}
                for name in order:
                    srv = servers[name]
                    runs[name] = await run_load(srv.port, n, num, f"ab{name}{n}.{r}", srv.proc.pid, srv.looper_tid)
                    runs[name].pop("_receipts")
                bare = runs["bare"]["messages_per_s"]
                rounds[n].append({"bare_messages_per_s": bare, **{f"{arm}_ratio": runs[arm]["tokens_per_s"] / bare
                                                                   for arm in ("A", "B")},
                                  **{f"{arm}_client_cpu_us_per_msg": runs[arm]["client_cpu_us_per_msg"]
                                     for arm in ("bare", "A", "B")}})
                print(f"round {r}, {n} streams: A {rounds[n][-1]['A_ratio']:.3f}, B {rounds[n][-1]['B_ratio']:.3f} "
                      f"x bare ({bare:,.0f} msgs/s)", file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {"a": str(ROOT), "b": str(checkout), "b_commit": commit(checkout),
           "rounds": {str(n): runs for n, runs in rounds.items()}}
    for n, runs in rounds.items():
        a, b = (statistics.median(x[f"{arm}_ratio"] for x in runs) for arm in ("A", "B"))
        out[f"median_ratio_{n}"] = {"A": round(a, 3), "B": round(b, 3), "B_over_A": round(b / a, 3)}
        out[f"quartiles_{n}"] = {arm: [round(q, 3) for q in statistics.quantiles(
            [x[f"{arm}_ratio"] for x in runs], n=4)] if len(runs) > 1 else [] for arm in ("A", "B")}
        bare = statistics.fmean(x["bare_messages_per_s"] for x in runs)
        out[f"mean_rate_ratio_{n}"] = {arm: round(statistics.fmean(x[f"{arm}_ratio"] * x["bare_messages_per_s"]
                                                                   for x in runs) / bare, 3) for arm in ("A", "B")}
    return out


def summary(res: dict) -> dict:
    bare = {r["streams"]: r for r in res.get("bare", ())}
    out = {}
    for key, rows in (("ratio", res.get("messages", ())), ("token_ratio", res.get("coalesced", ())),
                      ("router_token_ratio", res.get("router", ()))):
        for r in rows:
            if r["streams"] not in bare:
                continue
            out[f"{key}_{r['streams']}"] = round(r["tokens_per_s"] / bare[r["streams"]]["messages_per_s"], 3)
    for name in ("paced", "paced-burst", "bare-paced", "router-paced"):
        for r in res.get(name, ()):
            key = name.replace("-", "_")
            out[f"{key}_p50_ms_{r['streams']}"] = round(r.get("latency_p50_ms", float("nan")), 3)
            out[f"{key}_p99_ms_{r['streams']}"] = round(r.get("latency_p99_ms", float("nan")), 3)
            if "due_latency_p50_ms" in r:
                out[f"{key}_due_p50_ms_{r['streams']}"] = round(r["due_latency_p50_ms"], 3)
    if "idle" in res:
        out.update({f"idle_{k}": v for k, v in res["idle"].items()})
    return out


def print_table(res: dict) -> None:
    bare = {r["streams"]: r for r in res.get("bare", ())}
    print("| path | streams | tokens/s | messages/s | tokens/s ÷ bare msgs/s | server CPU µs/msg "
          "| server CPU % (main / looper) | client CPU % | latency p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in res.items():
        if name == "idle":
            continue
        for r in rows:
            ratio = (f'{r["tokens_per_s"] / bare[r["streams"]]["messages_per_s"]:.2f}'
                     if r["streams"] in bare else "—")
            lat = (f"{r['latency_p50_ms']:.2f} / {r['latency_p99_ms']:.2f}" if "latency_p50_ms" in r else "—")
            if "due_latency_p50_ms" in r:
                lat += f" (from due: {r['due_latency_p50_ms']:.2f} / {r['due_latency_p99_ms']:.2f})"
            print(f"| {name} | {r['streams']} | {r['tokens_per_s']:,.0f} | {r['messages_per_s']:,.0f} | "
                  f"{ratio} | {r['server_cpu_us_per_msg']:.0f} | {r['server_cpu_pct']:.0f} "
                  f"({r['server_main_cpu_pct']:.0f} / {r['looper_cpu_pct']:.0f}) | {r['client_cpu_pct']:.0f} | {lat} |")
    if "idle" in res:
        i = res["idle"]
        print(f"\nidle server over {i['seconds']:.0f} s: process {i['process_pct']:.2f} % of a core, "
              f"looper thread {i['looper_pct']:.3f} %")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) run one server process")
    s.add_argument("mode", choices=("bare", "full"))
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    s.add_argument("--record", default="")
    s.add_argument("--rate", type=float, default=None)
    s.add_argument("--stream-interval", type=int, default=1)
    s.add_argument("--no-coalesce", action="store_true")
    s.add_argument("--tokenize-inline-chars", type=int, default=None)
    s.add_argument("--front-cpu", default=None)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="its tokenizer picks the null executor's ids")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per scenario and concurrency (×8 coalesced)")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream in the paced scenario")
    p.add_argument("--flood-rate", type=float, default=4000.0,
                   help="tokens/s per stream of the free-running executor in the coalesced scenario")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved runs per throughput scenario; the best is kept")
    p.add_argument("--paced-repeat", type=int, default=3,
                   help="interleaved runs per paced scenario; the one with the median p50 is kept")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--front-cpu", default=None, help="the full servers' --front-cpu (default: the server's, auto)")
    p.add_argument("--scenarios", type=lambda v: v.split(","), default=list(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)} (ratios need bare)")
    p.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")], default=list(CONCURRENCY),
                   help="comma-separated concurrencies (default 1,64,256)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    p.add_argument("--ab-checkout", default=None, metavar="DIR",
                   help="A/B instead: this checkout's full path against DIR's (another checkout with its own .venv)")
    p.add_argument("--ab-rounds", type=int, default=24, help="--ab-checkout: interleaved rounds; medians reported")
    add_out_argument(p, "results-overhead.json")
    args = p.parse_args(argv)
    if args.cmd != "serve" and min(args.repeat, args.paced_repeat) < 1:
        p.error("--repeat and --paced-repeat must be >= 1")
    if args.cmd != "serve" and set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown scenario(s): {', '.join(sorted(set(args.scenarios) - set(SCENARIOS)))}")
    import uvloop
    if args.cmd == "serve":
        uvloop.run(serve(args))
        return 0
    if args.ab_checkout:
        res = uvloop.run(measure_ab(args))
        write(args.out, res)
        print("| streams | A ÷ bare (median) | B ÷ bare (median) | B ÷ A | A, B: mean rate ÷ bare's | rounds |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for n in args.streams:
            m, mean = res[f"median_ratio_{n}"], res[f"mean_rate_ratio_{n}"]
            print(f"| {n} | {m['A']:.3f} | {m['B']:.3f} | {m['B_over_A']:.3f} | {mean['A']:.3f}, {mean['B']:.3f} "
                  f"| {args.ab_rounds} |")
        return 0
    res = uvloop.run(measure(args))
    write(args.out, res)
    if args.json:
        print(json.dumps(summary(res)))
    else:
        print_table(res)
        print("\n" + json.dumps(summary(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
