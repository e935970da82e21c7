"""Chaos and soak: hundreds of misbehaving streams against a real `tokenloop serve`, then a leak check.

    .venv/bin/tokenloop-bench soak            # full: 400 streams (--out FILE writes the table; make soak OUT=bench/RESULTS-soak.md)
    .venv/bin/tokenloop-bench soak --quick    # 100 streams, < 60 s (tests/e2e/test_soak.py)

Loopback only, bounded in count and time. The server runs the default model with
TOKENLOOP_DEBUG_FAULT=request:SOAK-FAULT,position:POISON_POSITION (requests with that marker fail alone; a model
forward that reaches that position fails in the engine, and only the long prompt that reached it may fail); a
second server with step:N checks an engine death (every stream UNAVAILABLE, exit code 1). Then the "bad sampling
values" burst: good streams beside a burst of requests whose values once failed every request of an engine step
(temperature 1e-45, repetition_penalty 1e-40, stop_token_ids covering the vocabulary with min_new_tokens, a
structure that stop rules leave no token, a prompt the engine's forward fails on): every good stream must complete
with the tokens it gets without the burst, each bad one must get its own status, and the server must stay up
(GetLoad idle, engine alive). Afterwards the first
server must answer normally, GetLoad must show nothing running, waiting or holding KV blocks, its RSS outside
the KV cache (whose pages fault in as blocks are first written, up to its fixed size) must be within 10% of the
pre-soak level, and every Generate must have had exactly one terminal status
(checked on the client and in the server's JSON request-end log). Exit code 1 when a leak is found.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from tokenloop.bench.harness import DEFAULT_MODEL, ROOT, describe, free_port, machine, stop_process
from tokenloop.engine.hugepages import HUGE_PAGE, PAGE
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

MODEL = DEFAULT_MODEL
MARKER = "SOAK-FAULT"
POISON_POSITION = 1500  # TOKENLOOP_DEBUG_FAULT position:N on the soak server: only `bad_sampling`'s long prompt reaches it
GAVE_UP = ("CANCELLED", "DEADLINE_EXCEEDED")  # the client ended these itself
MAX_MESSAGE_BYTES = 1 << 20
ADMISSION = ("--max-concurrent-requests", "32", "--max-queue", "48")  # tight, so that bursts overflow it
KINDS = {"normal": 6, "n2": 1, "slow_reader": 2, "cancel": 3, "deadline": 3, "malformed": 3, "oversized": 1,
         "too_long": 1, "abort": 3, "duplicate_id": 1, "fault": 1}
PROMPTS = ["Tell me a story about a cat.", "List three colours:", "What is 2 + 2?", "Write a haiku about rain.",
           "The capital of France is"]


@dataclass
class Rss:
    """The soak server's resident bytes before and after, and of them the KV cache's backed pages: the leak check
    compares what lies outside the cache (its pages fault in as blocks are first written, up to its fixed size)."""

    rss0: int
    rss1: int
    kv0: int
    kv1: int

    @property
    def outside0(self) -> int:
        return self.rss0 - self.kv0

    @property
    def outside1(self) -> int:
        return self.rss1 - self.kv1


@dataclass
class Outcome:
    """What one Generate call ended with, as the client saw it."""

    kind: str
    request_id: str
    code: str
    num_completes: int = 0
    num_terminal: int = 1  # terminal statuses seen: must be exactly one
    reached_server: bool = True
    abort_errors: int = 0


KV_LOG = re.compile(r"KV cache [0-9.]+ GiB \((\d+) bytes")  # engine/model_setup.py's start-up line


def kv_arena_bytes(nbytes: int) -> int:
    """The huge-page region hugepages.zeros maps for a tensor of nbytes: whole pages, in whole 2 MiB."""
    pages = max(PAGE, -(-nbytes // PAGE) * PAGE)
    return -(-pages // HUGE_PAGE) * HUGE_PAGE


class ServerProcess:
    """A `tokenloop serve` child on a free loopback port, JSON logs collected."""

    def __init__(self, fault: str, *args: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "tokenloop.service.cli", "serve", "--model", str(MODEL), "--host", "127.0.0.1",
               "--port", str(self.port), "--log-format", "json", "--max-message-bytes", str(MAX_MESSAGE_BYTES), *args]
        env = {**__import__("os").environ, "TOKENLOOP_DEBUG_FAULT": fault}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError("tokenloop serve exited:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "tokenloop ready" in line:
                self.ready.set()

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def kv_resident_bytes(self) -> int:
        """Bytes of the KV cache backed by memory: the server maps its K and V caches unbacked (huge-page arenas,
        engine/hugepages.py `zeros`) and pages fault in as blocks are first written, so a soak that reaches blocks
        no earlier request wrote grows the RSS by up to the cache's size, bounded, not a leak. Found in
        /proc/PID/smaps as the two huge-page mappings of the size the start-up log gives; 0 where the cache is on
        torch's pages (written whole at allocation) or the log line is missing."""
        kv = next((int(m.group(1)) for line in self.lines if (m := KV_LOG.search(line))), None)
        if kv is None:
            return 0
        size_kb = kv_arena_bytes(kv // 2) >> 10
        resident, size, rss = 0, 0, 0
        for line in Path(f"/proc/{self.proc.pid}/smaps").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "Size":
                size, rss = int(rest.split()[0]), 0
            elif key == "Rss":
                rss = int(rest.split()[0])
            elif key == "VmFlags" and size == size_kb and "hg" in rest.split():
                resident += rss << 10
        return resident

    def request_ends(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            if '"request end"' in line:
                rec = json.loads(line)
                if rec.get("rpc", "").endswith("/Generate"):
                    out.append(rec)
        return out

    def stop(self, timeout: float = 60) -> int:
        return stop_process(self.proc, timeout)


def request(rng: random.Random, rid: str, kind: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text=rng.choice(PROMPTS), request_id=rid, stream=rng.random() < 0.8,
                             stopping=pb.StoppingCriteria(max_new_tokens=rng.randint(1, 16)),
                             sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0])))
    if kind == "n2":
        req.n = 2
    elif kind in ("cancel", "deadline", "abort", "slow_reader"):
        req.stream, req.stopping.max_new_tokens = True, rng.randint(16, 48)
    elif kind == "malformed":
        rng.choice([lambda: setattr(req.sampling, "temperature", float("nan")), lambda: setattr(req, "n", 999),
                    lambda: setattr(req, "text", ""), lambda: req.stopping.stop.extend(["x"] * 100),
                    lambda: req.token_ids.ids.extend([10**9]),
                    lambda: setattr(req.stopping, "max_new_tokens", 10**6)])()
    elif kind == "oversized":
        req.text = "x" * (MAX_MESSAGE_BYTES + 1024)  # refused by the transport before any handler
    elif kind == "too_long":
        req.text = "word " * 9000  # within the byte limit, beyond the model's context (8192)
    elif kind == "fault":
        req.text = f"{MARKER} {req.text}"
    return req


async def generate(stub, rng: random.Random, kind: str, rid: str, spread: float = 0.0) -> Outcome:
    await asyncio.sleep(rng.uniform(0, spread))  # bursts of arrivals, not one wall
    req = request(rng, rid, kind)
    timeout = rng.uniform(0.05, 1.0) if kind == "deadline" else 120
    call = stub.Generate(req, timeout=timeout)
    out, aborts = Outcome(kind, rid, "OK", reached_server=kind != "oversized"), None
    try:
        if kind == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.8), call.cancel)
        if kind == "abort":
            aborts = asyncio.ensure_future(abort_soon(stub, rng, rid))
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.HasField("complete"):
                out.num_completes += 1
            if kind == "slow_reader":
                await asyncio.sleep(rng.uniform(0.05, 0.3))
    except asyncio.CancelledError:
        out.code = "CANCELLED"
    except grpc.aio.AioRpcError as err:
        out.code = err.code().name
        late = err.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
        out.num_terminal += int(late and out.num_completes == (req.n or 1))  # an error after every Complete
    if out.code == "OK" and out.num_completes != (req.n or 1):
        out.num_terminal = 0  # ended OK without a Complete for every sequence
    if aborts is not None:
        out.abort_errors = await aborts
    return out


async def abort_soon(stub, rng: random.Random, rid: str) -> int:
    """Abort a live id twice at once, and a stale one; returns how many Abort calls failed."""
    await asyncio.sleep(rng.uniform(0.05, 0.6))
    got = await asyncio.gather(*(stub.Abort(pb.AbortRequest(request_id=r), timeout=10)
                                 for r in (rid, rid, rid + "-stale")), return_exceptions=True)
    return sum(isinstance(g, BaseException) for g in got)


async def abort_storm(stub, rng: random.Random, ids: list[str], num: int) -> int:
    """Aborts of live, finished, duplicate and never-seen ids; returns how many errored (must be 0)."""
    errors = 0
    for i in range(num):
        rid = rng.choice(ids) if ids and rng.random() < 0.7 else f"stale-{i}"
        try:
            await stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
        except grpc.aio.AioRpcError:
            errors += 1
        await asyncio.sleep(0.005)
    return errors


async def soak(port: int, num: int, seed: int, limit_s: float) -> tuple[list[Outcome], int]:
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
    stubs = [pb_grpc.TextGenerationStub(c) for c in channels]
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=num)
    ids = [f"soak-{i}" for i in range(num)]
    tasks = []
    for i, kind in enumerate(kinds):
        rid = ids[i - 1] if kind == "duplicate_id" and i else ids[i]
        tasks.append(asyncio.ensure_future(generate(stubs[i % 4], random.Random(rng.random()), kind, rid, num / 40)))
    storm = asyncio.ensure_future(abort_storm(stubs[0], random.Random(seed + 1), ids, num // 2))
    await asyncio.wait(tasks + [storm], timeout=limit_s)
    outcomes = []
    for task, kind, rid in zip(tasks, kinds, ids):
        if task.done():
            outcomes.append(task.result())
        else:  # still open after the time limit: no terminal status (a leak, or a too-short --limit)
            task.cancel()
            outcomes.append(Outcome(kind, rid, "HUNG", num_terminal=0))
    abort_errors = storm.result() if storm.done() else 1
    for c in channels:
        await c.close()
    return outcomes, abort_errors + sum(o.abort_errors for o in outcomes)


async def warm_up(port: int, num: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        await asyncio.gather(*(stub.Generate(pb.GenerateRequest(text=PROMPTS[i % 5], stream=False,
                                             stopping=pb.StoppingCriteria(max_new_tokens=16))).read()
                               for i in range(num)))


async def settle(port: int, timeout: float = 30) -> tuple[pb.Load, bool]:
    """GetLoad until nothing runs, waits or holds KV blocks; then one normal greedy request."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        end = time.monotonic() + timeout
        while True:
            load = await stub.GetLoad(pb.GetLoadRequest())
            idle = not (load.num_running or load.num_waiting or load.num_in_flight or load.kv_blocks_used)
            if idle or time.monotonic() > end:
                break
            await asyncio.sleep(0.2)
        msgs = [m async for m in stub.Generate(pb.GenerateRequest(
            text="The capital of France is", sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_new_tokens=4)))]
        return load, bool(msgs) and msgs[-1].complete.usage.completion_tokens > 0


async def engine_death(num: int) -> tuple[collections.Counter, int]:
    """A server whose engine dies after a few polls: every open stream UNAVAILABLE, exit code 1."""
    server = ServerProcess("step:20")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.TextGenerationStub(ch)
            rng = random.Random(7)
            outs = await asyncio.gather(*(generate(stub, rng, "cancel" if i % 4 == 0 else "slow_reader", f"d{i}")
                                          for i in range(num)))
        return collections.Counter(o.code for o in outs), await asyncio.to_thread(server.proc.wait, 60)
    finally:
        server.stop()


def bad_sampling_requests(num: int) -> list[tuple[str, pb.GenerateRequest, str]]:
    """`num` requests (name, request, the status it must get), cycling through the values a hostile-client probe
    found failing every request of an engine step (issue 28)."""
    from tokenloop.core.tokenizer import ModelCard, Tokenizer

    tok, card = Tokenizer.from_dir(MODEL), ModelCard.from_dir(MODEL)
    vocab = card.vocab_size
    starts_a = [t for t in range(vocab) if (text := tok.decode([t], skip_special_tokens=False)) and "a".startswith(text)]
    kinds = [
        ("temperature 1e-45", pb.GenerateRequest(text="List three colours:", sampling=pb.SamplingParams(
            temperature=1e-45), stopping=pb.StoppingCriteria(max_new_tokens=8)), "OK"),  # greedy (< 1e-5)
        ("repetition_penalty 1e-40", pb.GenerateRequest(text="List three colours:", sampling=pb.SamplingParams(
            temperature=0.7, repetition_penalty=1e-40), stopping=pb.StoppingCriteria(max_new_tokens=8)),
         "INVALID_ARGUMENT"),
        ("stop_token_ids cover the vocabulary", pb.GenerateRequest(text="Hi", stopping=pb.StoppingCriteria(
            max_new_tokens=8, min_new_tokens=2, stop_token_ids=[t for t in range(vocab)
                                                                 if t not in card.eos_token_ids])),
         "INVALID_ARGUMENT"),
        ("regex + stop rules: no token allowed", pb.GenerateRequest(text="Say a:", regex="a", sampling=pb.SamplingParams(
            temperature=0.9), stopping=pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=1,
                                                          stop_token_ids=starts_a)), "INVALID_ARGUMENT"),
        ("forward fails on its prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1000 + i % 500 for i in range(
            POISON_POSITION + 50)]), stopping=pb.StoppingCriteria(max_new_tokens=4)), "INTERNAL"),
    ]
    return [kinds[i % len(kinds)] for i in range(num)]


def good_request(i: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0) if i % 2 == 0 else pb.SamplingParams(temperature=0.8, seed=i)
    return pb.GenerateRequest(text=f"{PROMPTS[i % len(PROMPTS)]} ({i})", stream=True, sampling=sampling,
                              stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))


async def outcome_of(call) -> tuple[str, list[int]]:
    ids = []
    try:
        async for msg in call:
            if msg.HasField("complete"):
                ids = list(msg.complete.token_ids)
        return "OK", ids
    except grpc.aio.AioRpcError as err:
        return err.code().name, []


async def bad_sampling(port: int, num_good: int, num_bad: int, num_in_a_row: int) -> dict:
    """`num_good` streams alone, then again beside a burst of `num_bad` bad requests; then `num_in_a_row` bad
    requests one after another (those that reach the engine) and one good stream: what each got."""
    bad = await asyncio.to_thread(bad_sampling_requests, max(num_bad, num_in_a_row * 3))
    in_a_row = [b for b in bad if b[0].startswith(("regex", "forward"))][:num_in_a_row]  # they reach the engine
    bad = bad[:num_bad]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        alone = await asyncio.gather(*(outcome_of(stub.Generate(good_request(i), timeout=120)) for i in range(num_good)))
        calls = [stub.Generate(good_request(i), timeout=120) for i in range(num_good)]
        calls += [stub.Generate(r, timeout=120) for _, r, _ in bad]
        together = await asyncio.gather(*(outcome_of(c) for c in calls))
        row = [await outcome_of(stub.Generate(r, timeout=120)) for _, r, _ in in_a_row]
        after = await outcome_of(stub.Generate(good_request(0), timeout=120))
    got = collections.defaultdict(collections.Counter)
    for (name, _, _), (code, _) in zip(bad + in_a_row, together[num_good:] + row):
        got[name][code] += 1
    return {"num_good": num_good, "num_bad": num_bad,
            "complete": sum(code == "OK" for code, _ in together[:num_good]),
            "identical": sum(a == b for a, b in zip(alone, together[:num_good])),
            "in_a_row": len(in_a_row), "after": after[0], "after_identical": after == alone[0],
            "bad": {name: dict(c) for name, c in got.items()},
            "unexpected": sorted({f"{name}: {code}" for (name, _, want), (code, _) in
                                  zip(bad + in_a_row, together[num_good:] + row) if code != want})}


def server_terminal_counts(server: ServerProcess, outcomes: list[Outcome]) -> tuple[list[str], int, int]:
    """Leaks found in the server's log: a Generate whose end was logged other than exactly once; with the number of
    request-end lines logged and of those the log says it left out.

    A call the client itself cancelled or let expire may have ended before the server saw it: for those, no line
    is fine, and more than one is still a leak. The lines of calls that did not end OK share a budget (service/
    logs.py FAILED_LINES: 50 at once, then 5 a second), and the next line logged counts those left out
    (`not_logged_before`; the soak ends with one refused call after a pause, `flush_failed_lines`, whose line counts
    the rest): a failed call's missing line is fine while the lines missing add up to no more than those counts.
    """
    recs = server.request_ends()
    seen = collections.Counter(rec["request_id"] for rec in recs)
    left_out = sum(rec.get("not_logged_before", 0) for rec in recs)
    most = collections.Counter(o.request_id for o in outcomes if o.reached_server)
    least = collections.Counter(o.request_id for o in outcomes if o.reached_server and o.code not in GAVE_UP)
    ok = collections.Counter(o.request_id for o in outcomes if o.reached_server and o.code == "OK")
    kinds = {o.request_id: f"{o.kind} {o.code}" for o in outcomes}
    leaks = [f"{rid} ({kinds[rid]}): {seen[rid]} request-end lines for {n} calls ({ok[rid]} OK)"
             for rid, n in most.items() if not ok[rid] <= seen[rid] <= n]
    missing = sum(max(0, least[rid] - seen[rid]) for rid in most)
    if missing > left_out:
        leaks.append(f"{missing} failed calls have no request-end line, the log counts {left_out} left out")
    return leaks, len(recs), left_out


async def flush_failed_lines(port: int) -> None:
    """One refused call after the failed-line budget has refilled a line (0.2 s at 5 a second): its line carries
    the count of every failed call's line left out since the last one logged."""
    await asyncio.sleep(0.5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            await pb_grpc.TextGenerationStub(ch).Generate(pb.GenerateRequest(text="", request_id="soak-flush")).read()
        except grpc.aio.AioRpcError:
            pass


async def run(args) -> tuple[str, bool]:
    server = ServerProcess(f"request:{MARKER},position:{POISON_POSITION}", *ADMISSION, "--stall-timeout", "10",
                           "--shutdown-grace", "5")
    try:
        await warm_up(server.port, 48)
        rss0, kv0, t0 = server.rss_bytes(), server.kv_resident_bytes(), time.monotonic()
        outcomes, abort_errors = await soak(server.port, args.num, args.seed, args.limit)
        soak_s = time.monotonic() - t0
        burst = await bad_sampling(server.port, args.bad_good, args.bad_num, args.bad_in_a_row)
        load, answers = await settle(server.port)
        await flush_failed_lines(server.port)
        await asyncio.sleep(1.5)  # the last request-end lines; the allocator settles
        rss1, kv1 = server.rss_bytes(), server.kv_resident_bytes()
        log_leaks, logged, left_out = server_terminal_counts(server, outcomes)
    finally:
        exit_code = await asyncio.to_thread(server.stop)
    death, death_exit = await engine_death(args.death_streams)
    leaks = list(log_leaks)
    leaks += [f"{o.request_id} ({o.kind}): {o.num_terminal} terminal statuses" for o in outcomes if o.num_terminal != 1]
    leaks += [f"{abort_errors} Abort calls failed"] if abort_errors else []
    leaks += [f"GetLoad after the soak: {str(load).strip()}"] if (load.num_running or load.num_waiting or
                                                                    load.num_in_flight or load.kv_blocks_used) else []
    leaks += ["the server did not answer normally afterwards"] if not answers else []
    rss = Rss(rss0, rss1, kv0, kv1)
    leaks += [f"RSS outside the KV cache {rss.outside0 >> 20} MiB -> {rss.outside1 >> 20} MiB (> 10%)"] \
        if rss.outside1 > rss.outside0 * 1.10 else []
    leaks += [f"SIGTERM exit code {exit_code}"] if exit_code != 0 else []
    leaks += [f"engine death: exit code {death_exit}"] if death_exit != 1 else []
    leaks += [f"bad sampling values: {burst['complete']}/{burst['num_good']} good streams complete"] \
        if burst["complete"] != burst["num_good"] else []
    leaks += [f"bad sampling values: unexpected status {u}" for u in burst["unexpected"]]
    leaks += [f"after {burst['in_a_row']} bad requests in a row a good stream got {burst['after']}"] \
        if burst["after"] != "OK" else []
    leaks += [f"engine death: statuses {dict(death)}"] if set(death) - {"UNAVAILABLE", "CANCELLED", "OK"} or \
        not death["UNAVAILABLE"] else []
    table = summary(args, outcomes, soak_s, load, rss, death, death_exit, leaks, burst, (logged, left_out))
    return table, not leaks


def summary(args, outcomes, soak_s, load, rss, death, death_exit, leaks, burst, lines_logged) -> str:
    by_status = collections.Counter(o.code for o in outcomes)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_kind[o.kind][o.code] += 1
    codes = sorted(by_status)
    where = machine()
    lines = [f"Run {where['date']} on {describe(where)} ({where['cpus']} CPUs, {where['machine']}).", "",
             f"Soak: {len(outcomes)} Generate streams (seed {args.seed}) in {soak_s:.1f} s against `tokenloop serve` "
             f"(default model {MODEL.name}, {' '.join(ADMISSION)}), arrivals spread over {args.num / 40:.1f} s, "
             f"plus an Abort storm of "
             f"{args.num // 2} and an engine death with {args.death_streams} open streams.", "",
             "| kind | " + " | ".join(codes) + " | total |", "|---" * (len(codes) + 2) + "|"]
    for kind in KINDS:
        if by_kind.get(kind):
            c = by_kind[kind]
            lines.append(f"| {kind} | " + " | ".join(str(c[k]) for k in codes) + f" | {sum(c.values())} |")
    lines.append("| **all** | " + " | ".join(f"**{by_status[k]}**" for k in codes) + f" | **{len(outcomes)}** |")
    lines += ["", f"- After: GetLoad running {load.num_running}, waiting {load.num_waiting}, in flight "
              f"{load.num_in_flight}, KV blocks used {load.kv_blocks_used}/{load.kv_blocks_total} "
              "(prefix-cached blocks are evictable and count as free)",
              f"- RSS: {rss.rss0 / 2**20:.0f} MiB before, {rss.rss1 / 2**20:.0f} MiB after; outside the KV cache "
              f"{rss.outside0 / 2**20:.0f} MiB before, {rss.outside1 / 2**20:.0f} MiB after "
              f"({(rss.outside1 / rss.outside0 - 1) * 100:+.1f}%; the KV cache's backed pages "
              f"{rss.kv0 / 2**20:.0f} -> {rss.kv1 / 2**20:.0f} MiB, as blocks are first written)",
              f"- Request-end lines of Generate: {lines_logged[0]} logged, {lines_logged[1]} of failed calls left out "
              "by the log's budget for them (service/logs.py FAILED_LINES; counted in the next line logged)",
              f"- Engine death (TOKENLOOP_DEBUG_FAULT=step:20): streams {dict(death)}, exit code {death_exit}",
              f"- Bad sampling values: {burst['num_good']} good streams beside {burst['num_bad']} bad requests: "
              f"{burst['complete']}/{burst['num_good']} good complete, tokens identical to a run without them "
              f"{burst['identical']}/{burst['num_good']}; then {burst['in_a_row']} bad requests in a row, after which a "
              f"good stream got {burst['after']} (tokens {'as before' if burst['after_identical'] else 'changed'}); "
              f"bad requests got {burst['bad']}",
              f"- Leaks found: {'none' if not leaks else len(leaks)}"]
    lines += [f"  - {leak}" for leak in leaks[:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="100 streams, < 60 s (for make test)")
    p.add_argument("--num", type=int, default=None, help="Generate streams (default 400, quick 100)")
    p.add_argument("--death-streams", type=int, default=None)
    p.add_argument("--bad-good", type=int, default=16, help="good streams beside the bad-sampling-values burst")
    p.add_argument("--bad-num", type=int, default=None, help="bad requests in that burst (default 40, quick 10)")
    p.add_argument("--bad-in-a-row", type=int, default=None,
                   help="bad requests that reach the engine, one after another, after the burst (default 60, quick 9)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--limit", type=float, default=None, help="seconds the streams may take in all")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the table as Markdown to FILE (none by default; make soak OUT=bench/RESULTS-soak.md "
                        "records a run)")
    args = p.parse_args(argv)
    args.num = args.num or (100 if args.quick else 400)
    args.death_streams = args.death_streams or (8 if args.quick else 24)
    args.bad_num = args.bad_num or (10 if args.quick else 40)
    args.bad_in_a_row = args.bad_in_a_row or (9 if args.quick else 60)
    args.limit = args.limit or (40 if args.quick else 300)
    table, ok = asyncio.run(run(args))
    print(table)
    if args.out:
        Path(args.out).write_text("# Chaos and soak results (`make soak`)\n\n" + table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
