"""`trtllm.TrtllmService/SubscribeKvEvents`: the executor's KV-cache events, as the Shepherd Model Gateway reads them.

One stream per subscriber (smg.grpc.common.KvEventBatch): each batch of the executor's `KvEventHub` with its
sequence number, its events (stored blocks with hash, parent hash, token ids and block size; removed hashes;
cleared) and an `EngineLoad` record; while the executor publishes nothing, a `load_only` heartbeat every
`kv_events_heartbeat` seconds repeating the last sequence number. `start_sequence_number` is the last batch the
subscriber applied: the kept batches after it come first; a number outside the history (from before a restart,
or too old) ends the call with OUT_OF_RANGE before any batch, SMG's signal to drop this worker's blocks and
subscribe from 0 (core/kv_events.py). A subscriber that falls `max_queued` batches behind (it stopped reading and HTTP/2
flow control parked this handler in a write) is cut off: the hub drops its queue at once and the engine thread
never waits for it; when it reads again, the message in flight is followed by DATA_LOSS (SMG's 'subscriber fell
behind': it drops the worker's blocks and subscribes from 0). gRPC cannot send a status while a write is pending,
so a subscriber that never reads again has its handler cancelled after `CUT_OFF_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from smg_grpc_proto.generated import common_pb2

from tokenloop.core.kv_events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EventBatch,
    ResumeOutOfRange,
    lora_of_cache_key,
)

log = logging.getLogger("tokenloop.service")

CUT_OFF_GRACE_S = 30.0  # how long a cut-off subscriber's parked write may wait for it to read again


class FellBehind(Exception):
    """The subscriber was cut off: its stream ends with DATA_LOSS."""


def event_message(event_id: int, event) -> common_pb2.KvCacheEvent:
    """One KvCacheEvent (vLLM / TensorRT-LLM shapes, as SMG's proto carries them)."""
    msg = common_pb2.KvCacheEvent(event_id=event_id)
    if isinstance(event, BlocksStored):
        stored = msg.stored
        for b in event.blocks:
            block = stored.blocks.add(block_hash=b.block_hash, token_ids=b.token_ids, block_size=event.block_size)
            if b.extra_key is not None:
                block.extra_keys.add(text=b.extra_key)
        if event.parent_hash is not None:
            stored.parent_block_hash = event.parent_hash
        stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
        stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        lora = lora_of_cache_key(event.blocks[0].extra_key) if event.blocks else ""
        if lora:
            stored.lora_name = lora
    elif isinstance(event, BlocksRemoved):
        msg.removed.block_hashes.extend(event.block_hashes)
        msg.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
    elif isinstance(event, CacheCleared):
        msg.cleared.SetInParent()
    return msg


class LoadRecords:
    """EngineLoad records from the App's load (the numbers GetLoad answers), numbered per stream."""

    def __init__(self, app):
        self.app = app
        self.samples = itertools.count(1)

    def record(self, load_only: bool) -> common_pb2.EngineLoad:
        load = self.app.load()
        rec = common_pb2.EngineLoad(
            running_requests=load.num_running, waiting_requests=load.num_waiting,
            token_usage=load.kv_cache_utilization, active_token_usage=load.kv_cache_utilization,
            max_running_requests=load.max_concurrent_requests, sample=next(self.samples), load_only=load_only)
        if load_only:  # telemetry beyond the routing core: on the heartbeat cadence only
            rec.cache_hit_rate = load.prefix_cache_hit_rate
            rec.num_used_tokens = load.kv_blocks_used * load.kv_block_size
            rec.max_total_num_tokens = load.kv_blocks_total * load.kv_block_size
        return rec


def batch_message(batch: EventBatch, load: common_pb2.EngineLoad) -> common_pb2.KvEventBatch:
    msg = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, load=load)
    msg.events.extend(event_message(batch.first_event_id + i, e) for i, e in enumerate(batch.events))
    return msg


async def kv_event_stream(app, hub, request, heartbeat: float, peer: str = ""):
    """The SubscribeKvEvents handler body: yields KvEventBatch messages until the client leaves or is cut off.
    Raises `ResumeOutOfRange` (before yielding anything) for a start_sequence_number outside the history, and
    `FellBehind` when the subscriber was cut off."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    wake = asyncio.Event()
    sub = None
    cut_off: list[bool] = []

    def on_loop() -> None:
        if sub is not None and sub.cut_off and not cut_off:
            cut_off.append(True)
            log.warning("KV-event subscriber %s fell %d batches behind: cutting it off", peer or "?", sub.max_queued)
            hub.unsubscribe(sub)  # the hub holds nothing more for it
            loop.call_later(CUT_OFF_GRACE_S, lambda: task.done() or task.cancel())  # it never read again
        wake.set()

    def notify() -> None:  # the publishing (engine) thread: one cheap hand-off, never a wait
        loop.call_soon_threadsafe(on_loop)  # RuntimeError once the loop is closed: the hub drops the subscription

    try:
        sub = hub.subscribe(notify, request.start_sequence_number)
    except ResumeOutOfRange as exc:
        log.warning("KV-event subscriber %s: %s", peer or "?", exc)
        raise
    log.info("KV-event subscriber %s joined (start_sequence_number %d; %d batches replayed; last published %d)",
             peer or "?", request.start_sequence_number, len(sub.queue), hub.last_sequence_number)
    loads = LoadRecords(app)
    last = hub.last_sequence_number  # what a heartbeat repeats until a batch goes out
    try:
        if request.load_records_before_first_batch:
            yield common_pb2.KvEventBatch(sequence_number=0, load=loads.record(load_only=True))
        while True:
            if sub.cut_off:
                raise FellBehind(f"this subscriber fell {sub.max_queued} batches behind and was cut off: drop what "
                                 "you know of this worker's cache and subscribe from 0")
            if not sub.queue:
                try:
                    await asyncio.wait_for(wake.wait(), heartbeat)
                except TimeoutError:
                    pass
            wake.clear()
            batches = sub.pop_all()
            if not batches:  # idle: a heartbeat with the load, repeating the last sequence number
                yield common_pb2.KvEventBatch(sequence_number=last, load=loads.record(load_only=True))
                continue
            load = loads.record(load_only=False)
            for batch in batches:
                yield batch_message(batch, load)
                last = batch.sequence_number
                if sub.cut_off:  # resumed from a write parked by flow control: the rest was dropped
                    break
    finally:
        hub.unsubscribe(sub)
        log.info("KV-event subscriber %s left", peer or "?")
