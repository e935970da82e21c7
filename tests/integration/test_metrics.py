"""Prometheus /metrics under load: running / waiting move, then return to 0; histograms count requests."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.scripted_executor import ScriptedExecutor
from tokenloop.service.metrics import stop_metrics_server
from tokenloop.v1 import tokenloop_pb2 as pb


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def poll(port: int, predicate, timeout: float = 10.0) -> dict[str, float]:
    """Scrape until `predicate(samples)` holds (or time runs out); returns the last scrape."""
    samples = {}
    for _ in range(int(timeout / 0.05)):
        samples = await asyncio.to_thread(scrape, port)
        if predicate(samples):
            break
        await asyncio.sleep(0.05)
    return samples


def test_metrics_follow_load_and_count_requests(tokenizer_dir):
    port = free_port()
    num = 5

    async def one(stub):
        request = pb.GenerateRequest(text="Hello world, hello metrics.", stream=True,
                                     stopping=pb.StoppingCriteria(max_new_tokens=20))
        return [m async for m in stub.Generate(request)]

    async def body():
        async with serving(tokenizer_dir, ScriptedExecutor(tick=0.05), max_concurrent_requests=2,
                           metrics_port=port) as (server, stub, ex):
            try:
                idle = await asyncio.to_thread(scrape, port)
                assert idle["tokenloop:num_requests_running"] == 0 and idle["tokenloop:num_requests_waiting"] == 0
                assert idle["tokenloop:kv_blocks_total"] == 64 and idle["tokenloop:kv_block_size"] == 16
                assert idle["tokenloop:cache_config_info{block_size=16,num_gpu_blocks=64}"] == 1
                tasks = [asyncio.ensure_future(one(stub)) for _ in range(num)]
                busy = await poll(port, lambda s: s["tokenloop:num_requests_running"] >= 1
                                  and s["tokenloop:num_requests_waiting"] >= 1)
                assert busy["tokenloop:num_requests_running"] >= 1 and busy["tokenloop:num_requests_waiting"] >= 1
                assert 0 < busy["tokenloop:kv_cache_usage_perc"] <= 1
                await asyncio.gather(*tasks)
                done = await poll(port, lambda s: s["tokenloop:num_requests_running"] == 0
                                  and s["tokenloop:num_requests_waiting"] == 0)
                assert done["tokenloop:num_requests_running"] == 0 and done["tokenloop:num_requests_waiting"] == 0
                assert done["tokenloop:requests_total{code=OK}"] == num
                assert done["tokenloop:request_success_total{finished_reason=length}"] == num
                for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                             "inter_token_latency_seconds", "request_queue_time_seconds",
                             "request_generation_tokens", "request_prompt_tokens"):
                    assert done[f"tokenloop:{name}_count"] == num, name
                assert done["tokenloop:request_generation_tokens_sum"] == 20 * num
                assert done["tokenloop:e2e_request_latency_seconds_sum"] > 0
            finally:
                stop_metrics_server(server.app)

    run(body())


def test_errors_are_counted_by_status_code(tokenizer_dir):
    port = free_port()

    async def body():
        async with serving(tokenizer_dir, metrics_port=port) as (server, stub, ex):
            try:
                bad = pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_new_tokens=10**6))
                try:
                    [m async for m in stub.Generate(bad)]
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                samples = await asyncio.to_thread(scrape, port)
                assert samples["tokenloop:requests_total{code=INVALID_ARGUMENT}"] == 1
            finally:
                stop_metrics_server(server.app)

    run(body())
