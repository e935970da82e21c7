"""Three real `tokenloop serve` workers behind the real Shepherd Model Gateway (`smg`), as `make cluster-demo` runs them.

`cache_aware` routing, fed by each worker's `SubscribeKvEvents`, sends requests that share a system prompt to the
worker that holds it (which worker served a request, and whether it hit, is read from each worker's /metrics),
with a higher prefix-cache hit rate than `round_robin` on other prompts of the same shape. Then one worker is
killed with SIGKILL: every later request through the router succeeds on the other two; restarted on its port,
it is used again, and the router, resuming its KV-event stream with a sequence number of the killed process, is
answered OUT_OF_RANGE and drops what it knew of that worker's cache. smg's own metrics (its Prometheus port) show
it applying our events to the positional index cache_aware routes on, and its debug log shows each repeat of a
system prompt routed by an overlap found in that index. Engine threads are limited to one per worker so three fit on two cores.
It runs once per smg worker protocol: vLLM (`vllm.grpc.engine.VllmEngine`, what smg detects on a worker serving both,
the default) and TensorRT-LLM (`--router-protocol trtllm`); smg is given no `runtime_type` either way.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.gateway import smg_binary
from tests.e2e.live_server import DEFAULT_MODEL, ROOT, free_port, stop_process, tokenloop_command

pytestmark = pytest.mark.e2e

NUM_GROUPS, PER_GROUP = 4, 4  # prompts sharing one system prompt, per policy
WORDS = ("river valley engine signal harbor lantern orbit meadow copper glacier ledger violin canyon "
         "compass thunder pepper marble falcon quartz timber").split()


class Worker:
    """A `tokenloop serve` child with /metrics and one engine thread; restartable on the same ports."""

    def __init__(self, log_dir: Path, index: int, protocol: str = "both"):
        self.protocol = protocol  # --router-protocol
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"worker{index}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [*tokenloop_command(), "serve", "--model", str(DEFAULT_MODEL), "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), "--num-threads", "1",
               "--shutdown-grace", "2", "--kv-events-heartbeat", "0.5", "--router-protocol", self.protocol]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log_path.open("a"), stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        return self.metrics() is not None and "ready" in self.log_path.read_text(errors="replace").lower()

    def metrics(self) -> dict[str, float] | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith("tokenloop:") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, 20)


class Router:
    """`smg launch --policy POLICY` in front of the workers."""

    def __init__(self, workers: list[Worker], policy: str, log_path: Path, log_level: str = "info"):
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
             "--worker-urls", *[f"grpc://{w.address}" for w in workers], "--model-path", str(DEFAULT_MODEL),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--log-level", log_level],
            cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def metric(self, name: str, *label_values: str) -> float:
        """The sum of smg's Prometheus samples `name` whose labels mention every one of `label_values`."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(v in line for v in label_values))

    def healthy(self) -> set[str]:
        try:
            return {w["url"].removeprefix("grpc://") for w in self.get("/workers").get("workers", [])
                    if w.get("is_healthy")}
        except OSError:
            return set()

    def chat(self, system: str, user: str) -> int:
        status, _ = self.chat_body(system, user)
        return status

    def chat_body(self, system: str, user: str) -> tuple[int, str]:
        body = json.dumps({"model": DEFAULT_MODEL.name, "temperature": 0, "max_tokens": 2,
                           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")[:500]

    def wait_serving(self, timeout: float = 120) -> None:
        """Until the router answers a chat. `/workers` can list three healthy workers a moment before smg routes
        to them (a full test run on two cores showed a 503 there); a short warm-up prompt that shares nothing
        with the measured ones."""
        wait(lambda: self.chat_body("Warm-up.", "Say hi.")[0] == 200, timeout, f"the router ({self.log_path.name})"
             " to answer a chat")

    def stop(self) -> None:
        stop_process(self.proc, 20)


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def system_prompt(rng: random.Random) -> str:
    return "You are a helpful assistant. Remember these words: " + " ".join(rng.choice(WORDS) for _ in range(120))


def counters(workers: list[Worker]) -> list[tuple[float, float]]:
    """(prompt tokens looked up, prompt tokens from the cache) per worker."""
    out = []
    for w in workers:
        m = w.metrics() or {}
        out.append((m.get("tokenloop:prefix_cache_queries_total", 0.0), m.get("tokenloop:prefix_cache_hits_total", 0.0)))
    return out


def run_groups(router: Router, workers: list[Worker], seed: int) -> tuple[list[list[int]], float]:
    """NUM_GROUPS system prompts x PER_GROUP questions, one request at a time; returns which worker served each
    request (by group) and the hit rate over them, both from the workers' metrics."""
    rng = random.Random(seed)
    served: list[list[int]] = []
    queried = hits = 0.0
    for g in range(NUM_GROUPS):
        system = system_prompt(rng)
        served.append([])
        for q in range(PER_GROUP):
            before = counters(workers)
            status, body = router.chat_body(system, f"Question {g}.{q}: which word comes {q + 1}th?")
            assert status == 200, (status, body)
            after = counters(workers)
            deltas = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
            (index,) = [i for i, d in enumerate(deltas) if d[0] > 0]
            served[-1].append(index)
            queried += deltas[index][0]
            hits += deltas[index][1]
    return served, hits / queried


@pytest.fixture(scope="module", params=["vllm", "trtllm"])
def cluster(request, tmp_path_factory):
    """(workers, log directory, the protocol smg must detect): workers serving both protocols (smg detects vLLM) or
    only TrtllmService."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    smg_binary()
    logs = tmp_path_factory.mktemp(f"cluster-{request.param}")
    workers = [Worker(logs, i, "both" if request.param == "vllm" else "trtllm") for i in range(3)]
    try:
        for w in workers:
            w.start()
        wait(lambda: all(w.ready() for w in workers), 300, "three workers")
        yield workers, logs, request.param
    finally:
        for w in workers:
            w.stop()


def test_cache_aware_routing_beats_round_robin_and_survives_a_killed_worker(cluster):
    workers, logs, protocol = cluster
    router = Router(workers, "cache_aware", logs / "smg-cache-aware.log", log_level="debug")
    try:
        wait(lambda: len(router.healthy()) == 3, 120, "the router to see three healthy workers")
        assert {w["runtime_type"] for w in router.get("/workers")["workers"]} == {protocol}
        router.wait_serving()
        wait(lambda: all("KV-event subscriber" in w.log_path.read_text(errors="replace") for w in workers), 30,
             "the router to subscribe to every worker's KV events")
        served, aware_rate = run_groups(router, workers, seed=1)
        for group in served:  # after the first request of a group, the group stays on the worker that holds it
            assert group[1:] == [group[0]] * (PER_GROUP - 1), served
        # smg's positional index of each serving worker's cache (what cache_aware scores overlap on), built from
        # the blocks our SubscribeKvEvents streams announced
        assert router.metric("smg_kv_event_batches_total", "applied") > 0
        for i in {group[0] for group in served}:
            assert router.metric("smg_kv_index_blocks", workers[i].address) > 0, (i, served)
        # smg's own account of each decision (debug log): every repeat of a system prompt was an overlap found in
        # that index ("event_hit"), not a guess from its approximate tree of routed requests
        decisions = re.sub(r"\x1b\[[0-9;]*m", "", router.log_path.read_text(errors="replace"))
        hits = re.findall(r'Event-driven routing worker="[^"]+" branch="event_hit" overlap_blocks=(\d+)', decisions)
        assert len(hits) >= NUM_GROUPS * (PER_GROUP - 1) and all(int(n) > 0 for n in hits), hits
    finally:
        router.stop()

    rr = Router(workers, "round_robin", logs / "smg-round-robin.log")
    try:
        wait(lambda: len(rr.healthy()) == 3, 120, "the round-robin router")
        rr.wait_serving()
        served_rr, rr_rate = run_groups(rr, workers, seed=2)  # other system prompts: nothing cached yet
    finally:
        rr.stop()
    print(f"cache_aware: hit rate {aware_rate:.2f}, workers by group {served}; "
          f"round_robin: hit rate {rr_rate:.2f}, workers by group {served_rr}")
    assert len({i for group in served_rr for i in group}) == 3
    assert aware_rate > rr_rate + 0.2, (aware_rate, rr_rate, served, served_rr)

    router = Router(workers, "cache_aware", logs / "smg-failover.log")
    try:
        wait(lambda: len(router.healthy()) == 3, 120, "the router to see three healthy workers")
        router.wait_serving()
        victim = workers[1]
        wait(lambda: router.metric("smg_kv_event_batches_total", victim.address, "applied"), 30,
             "the router to apply the victim's KV events (its cursor is then past 0)")
        victim.kill()
        rng = random.Random(3)
        with ThreadPoolExecutor(3) as pool:  # requests keep coming while the router learns the worker is gone
            statuses = list(pool.map(lambda i: router.chat(system_prompt(rng), f"After the kill, request {i}"),
                                     range(12)))
        assert statuses == [200] * 12, statuses
        victim.start()
        wait(victim.ready, 300, "the killed worker to come back")
        wait(lambda: victim.address in router.healthy(), 60, "the router to use the restarted worker")
        # the router resumed from its cursor of the killed process: OUT_OF_RANGE, so it dropped that worker's
        # blocks and subscribed from 0 (the new process numbers its batches from its own start time)
        wait(lambda: router.metric("smg_kv_event_resyncs_total", victim.address, "out_of_range"), 60,
             "the router to drop the restarted worker's old blocks (OUT_OF_RANGE)")
        assert "is not in this worker's KV-event history" in victim.log_path.read_text(errors="replace")
        with ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(lambda i: router.chat(system_prompt(rng), f"Restarted, request {i}"),
                                     range(9)))
        assert statuses == [200] * 9, statuses
        assert counters(workers)[1][0] > 0  # the fresh process served some of them
    finally:
        router.stop()
