"""SubscribeKvEvents through a real in-process server: resume or OUT_OF_RANGE, heartbeats, a subscriber that never reads.

The executor is the scripted one with a real `KvEventHub` whose batches the test publishes itself, so sequence
numbers are known exactly; the embedded engine's own events are checked in test_prefix_cache.py and, through
the real router, in tests/e2e/test_cluster.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import gen, read_all, serving, wait_for
from tests.scripted_executor import ScriptedExecutor
from tokenloop.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEventHub, StoredBlock


def scripted_with_hub(max_queued: int = 2048, **kw) -> ScriptedExecutor:
    ex = ScriptedExecutor(**kw)
    ex.kv_events = KvEventHub(max_queued=max_queued, first_sequence_number=1)
    return ex


def stored(n: int, parent: int | None = None, size: int = 4) -> BlocksStored:
    return BlocksStored(tuple(StoredBlock(1000 * n + i, tuple(range(i, i + size))) for i in range(2)), parent, size)


def subscribe(server, start: int = 0, **kw):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    call = tpb_grpc.TrtllmServiceStub(channel).SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=start, **kw))
    return channel, call


def test_batches_carry_the_events_smg_reads_and_resume_after_the_last_applied_number(tokenizer_dir):
    async def body():
        ex = scripted_with_hub()
        async with serving(tokenizer_dir, ex, kv_events_heartbeat=30.0) as (server, _stub, _):
            hub = ex.kv_events
            hub.publish([stored(1)])
            hub.publish([stored(2, parent=1001), BlocksRemoved((1000, 1001))])
            hub.publish([stored(3)])
            channel, call = subscribe(server, start=1)  # SMG sends the last number it applied
            async with channel:
                second, third = await call.read(), await call.read()
                assert (second.sequence_number, third.sequence_number) == (2, 3)  # the exact replay
                s, r = second.events
                assert s.stored.parent_block_hash == 1001 and [b.block_hash for b in s.stored.blocks] == [2000, 2001]
                assert list(s.stored.blocks[1].token_ids) == [1, 2, 3, 4] and s.stored.blocks[0].block_size == 4
                assert list(r.removed.block_hashes) == [1000, 1001]
                assert not any(e.HasField("cleared") for b in (second, third) for e in b.events)
                assert second.HasField("load") and not second.load.load_only
                assert [e.event_id for b in (second, third) for e in b.events] == [2, 3, 4]  # numbered across batches
                hub.publish([stored(4)])  # live batches follow the replay with no gap
                fourth = await call.read()
                assert fourth.sequence_number == 4
                assert not fourth.events[0].stored.HasField("parent_block_hash")  # a first block has none
                call.cancel()
                assert await wait_for(lambda: hub.num_subscribers == 0)
    run(body())


def test_a_number_from_before_a_restart_is_out_of_range_and_zero_starts_with_the_cleared_cache(tokenizer_dir):
    """What SMG's KV-event monitor does: OUT_OF_RANGE -> drop the worker's blocks, subscribe from 0; the replay
    from 0 begins with the executor's first batch, `cleared` (the embedded engine's fresh cache)."""
    async def body():
        ex = scripted_with_hub()
        async with serving(tokenizer_dir, ex, kv_events_heartbeat=30.0) as (server, _stub, _):
            hub = ex.kv_events
            hub.publish([CacheCleared()])
            hub.publish([stored(2)])
            channel, call = subscribe(server, start=500)  # the router's cursor from the worker's previous life
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
                assert "start_sequence_number 500 is not in this worker's KV-event history (kept: 1..2)" in \
                    err.value.details()
                assert await wait_for(lambda: hub.num_subscribers == 0)
            channel, call = subscribe(server, start=0)
            async with channel:
                first, second = await call.read(), await call.read()
                assert first.sequence_number == 1 and [e.WhichOneof("data") for e in first.events] == ["cleared"]
                assert second.sequence_number == 2 and second.events[0].HasField("stored")
                call.cancel()
    run(body())


def test_an_adapter_key_travels_as_extra_key_and_lora_name():
    from tokenloop.service.kv_events import event_message

    block = StoredBlock(5, (1, 2, 3, 4), "lora:sql:abc123")
    msg = event_message(7, BlocksStored((block,), 4, 4))
    assert msg.event_id == 7 and msg.stored.lora_name == "sql" and msg.stored.parent_block_hash == 4
    assert [k.text for k in msg.stored.blocks[0].extra_keys] == ["lora:sql:abc123"]


def test_an_idle_worker_sends_load_heartbeats(tokenizer_dir):
    async def body():
        ex = scripted_with_hub()
        async with serving(tokenizer_dir, ex, kv_events_heartbeat=0.1) as (server, _stub, _):
            ex.kv_events.publish([stored(1)])
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = tpb_grpc.TrtllmServiceStub(channel)
                call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
                    start_sequence_number=1, load_records_before_first_batch=True))
                first = await call.read()
                assert first.sequence_number == 0 and first.load.load_only and not first.events
                beats = [await asyncio.wait_for(call.read(), 5) for _ in range(3)]
                assert all(b.load.load_only and not b.events for b in beats)
                assert [b.sequence_number for b in beats] == [1, 1, 1]  # the last sequence, repeated
                samples = [first.load.sample] + [b.load.sample for b in beats]
                assert samples == sorted(samples) and len(set(samples)) == 4
                assert beats[0].load.HasField("cache_hit_rate") and beats[0].load.max_running_requests == 64
                call.cancel()
    run(body())


def test_a_subscriber_that_stops_reading_is_cut_off_generation_goes_on_and_it_reads_data_loss(tokenizer_dir):
    async def body():
        ex = scripted_with_hub(max_queued=8)
        async with serving(tokenizer_dir, ex, kv_events_heartbeat=30.0) as (server, _stub, _):
            hub = ex.kv_events
            # a tiny HTTP/2 receive window: a client that does not read stops the server's writes at once
            options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as lazy, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = tpb_grpc.TrtllmServiceStub(lazy).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
                assert await wait_for(lambda: hub.num_subscribers == 1)
                big = BlocksStored(tuple(StoredBlock(i, tuple(range(256))) for i in range(64)), None, 256)
                for _ in range(200):  # ~ 100 KB each: far past the window; publish never waits
                    hub.publish([big])
                    await asyncio.sleep(0)
                assert await wait_for(lambda: hub.num_cut_off == 1 and hub.num_subscribers == 0, timeout=10)
                out = await read_all(tpb_grpc.TrtllmServiceStub(channel).Generate(gen([5, 6, 7], max_tokens=4)))
                assert out[-1].HasField("complete") and len(out[-1].complete.output_token_ids) == 4
                with pytest.raises(grpc.aio.AioRpcError) as err:  # reading again: what was in flight, then the end
                    for _ in range(20):
                        await asyncio.wait_for(call.read(), 10)
                assert err.value.code() == grpc.StatusCode.DATA_LOSS  # SMG: drop the worker's blocks, resubscribe
                assert "fell 8 batches behind" in err.value.details()
    run(body())
