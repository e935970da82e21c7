"""tokenloop.v1.TextGeneration: the public RPCs, on the shared looper."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from tokenloop.looper.stream import Complete, RequestFailed
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

from . import convert, embedding
from .errors import AlreadyExists, ServiceError, ValidationError, abort_with, status_of
from .logs import RequestRecord, logs_itself
from .validation import text_size

log = logging.getLogger("tokenloop.service")
GENERATE = f"/{pb.DESCRIPTOR.services_by_name['TextGeneration'].full_name}/Generate"  # the RPC's gRPC path


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""


class StallWatchdog:
    """Acts when the handler's writes make no progress (a reader that stopped reading): after `grace` it calls
    `on_slow` once per stall (the stream gives back its slot), after `timeout` it cancels the handler's task.

    grpc.aio resumes a streaming handler only after its yielded message was accepted, so a reader
    that stops reading (and HTTP/2 flow control filling up) parks the handler at `yield`; the
    cancellation then runs its cleanup, which cancels the request and frees its KV blocks.
    The handler marks a batch of writes with `arm()` / `disarm()` and counts each accepted message in
    `sent` (an attribute increment: nothing else runs per message). One timer per stream, started by
    an `arm()` and re-armed only while writing, looks every `period` (a quarter of the grace, else the timeout);
    a look that finds `sent` where the previous one left it counts one still period, so a write that stopped is
    seen a grace to a grace and a quarter after its last progress, and cut off once the still periods add up to
    `timeout` (without a grace: one to two timeouts).
    """

    __slots__ = ("timeout", "grace", "period", "on_slow", "task", "timer", "loop", "writing", "sent", "seen",
                 "still_s")

    def __init__(self, timeout: float, grace: float = 0.0, on_slow: Callable[[], None] | None = None):
        self.timeout = timeout  # 0: never cancel
        use_grace = on_slow is not None and grace > 0 and (timeout == 0 or grace < timeout)
        self.grace = grace if use_grace else 0.0
        self.period = grace / 4 if use_grace else timeout
        self.on_slow = on_slow if use_grace else None
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.timer = None
        self.writing = False  # between arm() and disarm(): the handler is writing a batch
        self.sent = 0  # messages grpc accepted (the handler counts them)
        self.seen = 0  # `sent` when the timer last looked
        self.still_s = 0.0  # seconds of looks in a row that found no progress

    def arm(self) -> None:
        self.writing = True
        if self.timer is None and self.period > 0:
            self.seen, self.still_s = self.sent, 0.0
            self.period = self.grace / 4 or self.timeout
            self.timer = self.loop.call_later(self.period, self._check)

    def disarm(self) -> None:
        self.writing = False

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        if not self.writing or self.task.done():
            return  # waiting for tokens, not writing (the next arm() starts a timer), or the handler is gone
        if self.sent != self.seen:  # progress since the last look: look again one period later
            self.seen, self.still_s = self.sent, 0.0
            self.period = self.grace / 4 or self.timeout
        else:
            slow = self.still_s < self.grace  # not yet a slow reader
            self.still_s += self.period
            if self.timeout > 0 and self.still_s >= self.timeout - 1e-9:
                log.warning("a reader stopped reading for %.1fs: aborting its stream", self.timeout)
                self.task.cancel()
                return
            if slow and self.still_s >= self.grace - 1e-9:
                self.on_slow()
                if self.timeout == 0:
                    return  # nothing more to do for this stall: the next arm() looks again
                self.period = self.grace  # till the timeout, look less often
        self.timer = self.loop.call_later(self.period, self._check)


class Delivery:
    """One Generate call's delivery of its request stream, shared by both APIs' handlers: the stall watchdog, the
    admission slot (given back while the reader stalls, taken again when it reads), the `Complete`s seen, and on
    the way out (a return, an error, a cancellation at `yield`) the cancel of a request that did not finish and
    `app.observe_end`. The per-message loop stays in each handler: a shared async generator would be one more
    frame to resume for every message."""

    __slots__ = ("app", "valid", "stream", "slot", "watchdog", "completes", "paused")

    def __init__(self, app, valid, stream, slot=None):
        self.app, self.valid, self.stream, self.slot = app, valid, stream, slot
        self.watchdog = StallWatchdog(app.config.stall_timeout, getattr(app.config, "slow_reader_grace", 0.0),
                                      self._slow if slot is not None else None)
        self.completes: list[Complete] = []
        self.paused = False  # the slot was given back; `resume()` before reading the stream again

    def __enter__(self) -> Delivery:
        return self

    def delivered(self, batch: list) -> None:
        """Every message of `batch` was written."""
        self.watchdog.disarm()
        self.completes += [e for e in batch if type(e) is Complete]

    def _slow(self) -> None:
        """The reader stopped reading: give the slot to another request, pausing this one's generation (an
        executor that cannot pause keeps generating: the slot stays, as before --slow-reader-grace)."""
        stream = self.stream
        if self.paused or not (stream.ended or self.app.looper.can_pause):
            return
        self.paused = True
        stream.pause()  # no-op once generation ended
        self.slot.give_back()

    async def resume(self) -> None:
        """The reader reads again: take a slot (in line, within --max-queue-wait) and resume generation."""
        if not (self.stream.ended or self.stream.cancelled):  # a cancelled one only delivers its end
            await self.slot.take_again()
            self.stream.resume()
        self.paused = False

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.watchdog.close()
        stream = self.stream
        if not stream.finished:
            stream.cancel()  # client gone, deadline, stalled reader, or server abort
        self.app.observe_end(self.valid, self.completes, grpc.StatusCode.OK if stream.finished else None)
        return False


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


def add_with_raw_responses(add_to_server, servicer, server, method: str) -> None:
    """Register `servicer` with its generated `add_..._to_server` function, except that `method` yields its
    messages already serialized: its handler has no response serializer, so grpc sends those bytes as they are.
    The generated function stays the one source of the method table; only that one handler is changed."""
    class Capture:
        registered = None

        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.registered = (name, handlers)

    capture = Capture()
    add_to_server(servicer, capture)
    if capture.registered is None:
        raise RuntimeError(f"{add_to_server.__name__} did not register its methods (generated code too old?)")
    name, handlers = capture.registered
    handlers = dict(handlers, **{method: handlers[method]._replace(response_serializer=None)})
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def add_text_generation(servicer: TextGenerationServicer, server) -> None:
    """tokenloop.v1.TextGeneration, with Generate yielding serialized messages (`StreamWriter.encode`)."""
    add_with_raw_responses(pb_grpc.add_TextGenerationServicer_to_server, servicer, server, "Generate")


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    """Validates at the door, admits, submits to the looper, streams events back."""

    def __init__(self, app):
        self.app = app  # service.app.App

    @logs_itself  # no interceptor generator around this one: see service.logs.logs_itself
    async def Generate(self, request, context):
        async with RequestRecord(GENERATE, request, context):
            app, arrival = self.app, time.monotonic()
            rid = request.request_id or metadata_value(context, "x-request-id") or uuid.uuid4().hex
            try:
                app.require_ready()
                async with app.admission.slot(rid, app.config.max_queue_wait, context.peer()) as slot:
                    valid = await app.tokenizing(text_size(request), app.validator.generate, request, rid,
                                                 deadline_of(context))
                    valid = await app.grammars.admit(valid)  # a `structured` constraint: compiled, or cached
                    valid = await app.loras.admit(valid)  # a LoRA adapter: resident (read again if swapped out)
                    if app.looper.find(rid) is not None:
                        raise AlreadyExists(f"`request_id` {rid!r} is already in flight")
                    slot.check_aborted()  # Abort while it waited: it never runs
                    stream = app.looper.submit(valid, arrival)
                    app.admission.submitted(slot)
                    writer = convert.StreamWriter(valid, app.config.stream_interval, app.config.coalesce)
                    with Delivery(app, valid, stream, slot) as delivery:
                        watchdog = delivery.watchdog
                        while (batch := await stream.next_batch()) is not None:
                            watchdog.arm()
                            for msg in writer.encode(batch):  # serialized: see add_text_generation
                                yield msg  # returns once grpc took the message: a stalled reader blocks here
                                watchdog.sent += 1
                            delivery.delivered(batch)
                            if delivery.paused:  # it stalled past --slow-reader-grace and now reads again
                                await delivery.resume()
            except (ServiceError, RequestFailed) as exc:
                app.observe_error(status_of(exc)[0])
                await abort_with(context, exc)

    async def Tokenize(self, request, context):
        try:
            self.app.require_ready()
            return await self.app.tokenizing(text_size(request), self._tokenize, request)
        except ServiceError as exc:
            await abort_with(context, exc)

    def _tokenize(self, request) -> pb.TokenizeResponse:
        """The prompt limit of Generate applies: a text that cannot fit is refused untokenized (where the tokenizer
        bounds a token's characters), and one that tokenizes to more tokens than the limit is refused after."""
        which = request.WhichOneof("input")
        validator = self.app.validator
        chat = validator.render_chat(request.chat) if which == "chat" else None
        text = chat.text if chat is not None else request.text
        validator.check_text_length(text, which or "text")
        tok = self.app.tokenizer
        if chat is not None:  # as Generate encodes it: special-token text in content stays text
            ids, tokens = tok.encode_chat(chat, add_special_tokens=tok.add_bos)
        else:
            ids, tokens = tok.encode_with_tokens(text, add_special_tokens=tok.add_bos)
        validator.check_prompt_length(len(ids))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, text=text if which == "chat" else "")

    async def Detokenize(self, request, context):
        try:
            self.app.require_ready()
            self.app.validator.detokenize_ids(request.token_ids)  # how many, then their range
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = await self.app.tokenizing(len(request.token_ids), self.app.tokenizer.decode, request.token_ids,
                                             skip)
            return pb.DetokenizeResponse(text=text)
        except ServiceError as exc:
            await abort_with(context, exc)

    async def GetModelInfo(self, request, context):
        try:
            self.app.require_ready()
            return self.app.model_info()
        except ServiceError as exc:
            await abort_with(context, exc)

    async def LoadLoraAdapter(self, request, context):
        try:
            self.app.require_ready()
            loras = self.app.loras
            adapter = await loras.load(request.name, request.path, request.id if request.HasField("id") else None)
            log.info("LoRA adapter %s loaded from %s (id %d, rank %d)", adapter.name, adapter.path, adapter.id,
                     adapter.rank)
            return loras.describe(adapter)
        except ServiceError as exc:
            await abort_with(context, exc)

    async def UnloadLoraAdapter(self, request, context):
        try:
            self.app.require_ready()
            adapter = await self.app.loras.unload(request.name)
            log.info("LoRA adapter %s unloaded", adapter.name)
            return pb.UnloadLoraAdapterResponse(adapter=self.app.loras.describe(adapter))
        except ServiceError as exc:
            await abort_with(context, exc)

    async def ListLoraAdapters(self, request, context):
        try:
            self.app.require_ready()
            loras = self.app.loras
            return pb.ListLoraAdaptersResponse(adapters=[loras.describe(a) for a in loras.list()])
        except ServiceError as exc:
            await abort_with(context, exc)

    async def GetLoad(self, request, context):
        return self.app.load()

    async def Abort(self, request, context):
        try:
            self.app.require_ready()
            rid = request.request_id
            return pb.AbortResponse(found=self.app.admission.abort(rid) or self.app.looper.abort(rid))
        except ServiceError as exc:
            await abort_with(context, exc)

    async def Embed(self, request, context):
        """The prompt's embedding through service.embedding.embed (the path smg's vLLM Embed takes too)."""
        app = self.app
        try:
            app.require_ready()
            rid = request.request_id or metadata_value(context, "x-request-id") or uuid.uuid4().hex
            pooling = embedding.pooling_of(request.pooling, pb.Pooling)
            normalize = request.normalize if request.HasField("normalize") else None
            if request.WhichOneof("input") is None:
                raise ValidationError("empty_input", "`input` must be set: one of `text`, `token_ids`")
            embedding.embed_params(app, pooling, normalize)  # UNIMPLEMENTED before tokenizing, on an executor without
            ids, _ = await app.tokenizing(text_size(request), app.validator.prompt, request)
            result = await embedding.embed(app, context, rid, ids, pooling, normalize,
                                           field="token_ids.ids" if request.HasField("token_ids") else "text")
            return pb.EmbedResponse(request_id=rid, embedding=result.vector, prompt_tokens=result.prompt_tokens,
                                    pooling=pb.Pooling.Value(result.pooling.upper()), normalized=result.normalized)
        except (ServiceError, RequestFailed) as exc:
            app.observe_error(status_of(exc)[0])
            await abort_with(context, exc)
