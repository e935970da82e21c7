"""The looper thread's scheduling policy on a real in-process server (--front-cpu auto, two CPUs or more): SCHED_BATCH
while the event loop is behind its readers, SCHED_OTHER once they keep up (service/placement.py tells why)."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.bench.null_executor import NullExecutor, sample_token_ids
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.v1 import tokenloop_pb2 as pb

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="the threads are pinned (and the policy set) only where two CPUs may be used")


async def read_tokens(stub, rid: str, num: int) -> int:
    call = stub.Generate(pb.GenerateRequest(request_id=rid, text="Tell me a story.", stream=True,
                                            stopping=pb.StoppingCriteria(max_new_tokens=num, ignore_eos=True)))
    tokens = 0
    while (msg := await call.read()) is not grpc.aio.EOF:
        tokens += len(msg.chunk.token_ids)
    return tokens


def test_the_looper_is_a_batch_thread_while_the_event_loop_is_behind_and_normal_once_it_keeps_up(tokenizer_dir):
    async def body():
        ex = NullExecutor(sample_token_ids(Tokenizer.from_dir(tokenizer_dir)))  # as fast as it is polled
        async with serving(tokenizer_dir, executor=ex, coalesce=False, front_cpu="auto") as (server, stub, _):
            tid = server.app.looper.thread_id
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            seen = set()

            async def watch():
                while True:
                    seen.add(os.sched_getscheduler(tid))
                    await asyncio.sleep(0.001)
            watcher = asyncio.create_task(watch())
            # 32 streams, one token per message, on one event loop with their server: its readers fall behind
            counts = await asyncio.gather(*(read_tokens(stub, f"flood{i}", 400) for i in range(32)))
            watcher.cancel()
            assert counts == [400] * 32
            assert os.SCHED_BATCH in seen
            # one stream alone keeps up (fewer than four streams are never "behind"): the looper is normal again
            assert await read_tokens(stub, "alone", 50) == 50
            return os.sched_getscheduler(tid)
    assert run(body()) == os.SCHED_OTHER
