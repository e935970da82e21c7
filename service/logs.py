"""Structured logs: `--log-format json|text`, and one line per finished RPC (id, peer, tokens, timings, status).

What a client sent reaches a line bounded (`bounded`: escaped, a field cut at 256 characters, a message at 4,096),
and the lines of calls that did not end OK share a budget (`FAILED_LINES`: 50 at once, then 5 a second; the next
line says how many were not logged), so a flood of refused calls cannot flood the log.

`RequestLogInterceptor` wraps every handler: it keeps the RPC's record in a context variable,
echoes `x-request-id` in the initial metadata, and logs the record when the handler ends. The
generation RPCs it is given (`own_records`: the front door's Generate handlers) do the same themselves,
in `async with RequestRecord(...)`, and it leaves them unwrapped: a wrapping async generator is one more
frame to resume for every message, which shows at hundreds of streams of one token per message.
`RequestLogObserver` (one of `app.observers`) fills in what the looper measured.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time

import grpc

from .errors import status_of

log = logging.getLogger("tokenloop.requests")
_record: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tokenloop_rpc", default=None)
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
MAX_FIELD_CHARS = 256  # a field of a log line (a client's request id, peer, ...): longer is cut, and says so
MAX_MESSAGE_CHARS = 4096  # a log line's message, and each line of a traceback after it


def _cut(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`bounded` without the escapes (JSON escapes its strings itself)."""
    return text if len(text) <= limit else f"{text[:limit]}...[cut: {len(text)} characters]"


def _cut_exception(formatter: logging.Formatter, exc_info) -> str:
    """A traceback with each line cut (an exception's text can carry what a client sent); JSON escapes it itself."""
    text = logging.Formatter.formatException(formatter, exc_info)
    return "\n".join(_cut(line, MAX_MESSAGE_CHARS) for line in text.split("\n"))


def _bound_exception(formatter: logging.Formatter, exc_info) -> str:
    """A traceback with each line bounded (`bounded`: escaped and cut) like any client value: an exception's text
    can carry what a client sent, and an ESC or a carriage return in it would reach the terminal or the log as is."""
    text = logging.Formatter.formatException(formatter, exc_info)
    return "\n".join(bounded(line, MAX_MESSAGE_CHARS) for line in text.split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any `extra=` fields."""

    formatException = _cut_exception

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
               "message": _cut(record.getMessage(), MAX_MESSAGE_CHARS)}
        out.update({k: _cut(v) if isinstance(v, str) else v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def bounded(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`text` escaped (`escape_controls`), cut after `limit` characters with its length said: what a client sent
    reaches a log line at a bounded size (an escape is at most 10 characters long)."""
    if len(text) <= limit:
        return escape_controls(text)
    return f"{escape_controls(text[:limit])}...[cut: {len(text)} characters]"


def escape_controls(text: str) -> str:
    """`text` with every unprintable character (newline, ESC, NUL, U+2028, ...) written as its Python escape, so
    that client-supplied text (a request id, a message) cannot start a forged log line or send terminal codes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _value(value) -> str:
    """An `extra=` value for the text format: escaped and bounded (`bounded`), and quoted (logfmt style) where it
    holds a space, a quote or `=`, so that a client's `request_id` cannot add fields of its own."""
    text = str(value)
    if not any(c in text for c in ' "='):
        return bounded(text)
    return '"' + bounded(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...` (the `extra=` fields appended); the message and the values with
    control characters escaped (a traceback that follows keeps its lines, each escaped and cut the same way)."""

    formatException = _bound_exception

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = bounded(record.message, MAX_MESSAGE_CHARS)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={_value(v)}" for k, v in vars(record).items() if k not in _STD_ATTRS)
        return super().format(record) + (" " + extras if extras else "")


class LineBudget:
    """A token bucket of log lines: `burst` at once, then `rate` a second; `take()` says whether a line may go out,
    `left_out()` how many did not since the last one that did (and starts counting again)."""

    __slots__ = ("rate", "burst", "tokens", "last", "suppressed", "clock")

    def __init__(self, rate: float = 5.0, burst: float = 50.0, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.last, self.suppressed = burst, clock(), 0

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False

    def left_out(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count

    def reset(self) -> None:
        """The full burst again (a new server: one process's earlier servers spent theirs)."""
        self.tokens, self.last, self.suppressed = self.burst, self.clock(), 0


class RateLimitedLog:
    """At most one line per `interval` seconds for one kind of event a client can repeat at will (undecodable
    requests, refused API keys); the next line says how many were left out since the last one."""

    __slots__ = ("logger", "interval", "last", "suppressed", "clock")

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock=time.monotonic):
        self.logger, self.interval, self.clock = logger, interval, clock
        self.last = -float("inf")
        self.suppressed = 0

    def warning(self, message: str, *args) -> bool:
        """Log `message % args` unless a line went out less than `interval` ago; True when it was logged."""
        now = self.clock()
        if now - self.last < self.interval:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += f" (and {self.suppressed} more like it in the last %.0fs)"
            args += (now - self.last,)
        self.last, self.suppressed = now, 0
        self.logger.warning(message, *args)
        return True


FAILED_LINES = LineBudget()  # request lines of calls that did not end OK: 50 at once, then 5 a second


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once for the process."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def current_record() -> dict | None:
    """The record of the RPC this task is serving, if any."""
    return _record.get()


class RequestLogObserver:
    """An `app.observers` entry: copies tokens, finish reasons and timings into the RPC's record."""

    def on_request_end(self, valid, completes, code, streamed) -> None:
        """`streamed`: tokens per sequence that its chunks carried. A sequence with no `Complete` (the call was cut
        short) counts those, and its finish reason is `cancelled`: the record's `status` says why (CANCELLED: the
        client left; UNAVAILABLE: drained at shutdown; DEADLINE_EXCEEDED; INTERNAL: the executor failed it)."""
        rec = _record.get()
        if rec is None:
            return
        rec["request_id"] = valid.request_id
        rec["prompt_tokens"] = len(valid.prompt_token_ids)
        ends = {c.index: (len(c.token_ids), c.finish_reason.name.lower()) for c in completes}
        if valid.embed is None:  # a generation: every sequence made tokens, finished or not
            ends = {i: ends.get(i) or (streamed.get(i, 0), "cancelled") for i in range(valid.n)}
        rec["output_tokens"] = sum(n for n, _ in ends.values())
        rec["finish_reason"] = ",".join(reason for _, reason in (ends[i] for i in sorted(ends))) or None
        s = valid.sampling  # what the request ran with, its defaults applied (docs/router.md)
        rec.update(temperature=round(s.temperature, 6), top_p=round(s.top_p, 6), seed=s.seed,
                   max_new_tokens=valid.stopping.max_new_tokens)
        if completes:
            rec["queue_s"] = round(max(c.timing.queue_s for c in completes), 6)
            rec["ttft_s"] = round(min(c.timing.ttft_s for c in completes), 6)

    def on_error(self, code) -> None:
        pass


def _metadata(pairs) -> dict[str, str]:
    return {k: v for k, v in (pairs or ()) if isinstance(v, str)}


def _outcome(exc: BaseException | None, context) -> str:
    if exc is None:
        return "OK"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: grpc closed the stream at a yield
        return "CANCELLED"
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return status_of(exc)[0].name


async def _hide_unexpected(exc: BaseException, context) -> None:
    """A bug's exception: log it here, tell the client only its type (grpc would send its text)."""
    if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
        log.error("unexpected error in an RPC", exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")


class RequestRecord:
    """One streaming RPC's log record, around its handler's body: `async with` opens it and echoes
    `x-request-id` in the initial metadata; on the way out a bug's exception is hidden from the client
    (`_hide_unexpected`) and the record is logged. The interceptor's stream wrapper and the front door's
    Generate (service.frontdoor) both use it. `meta`: the call's metadata (None: read it from `context`)."""

    __slots__ = ("method", "meta", "request", "context", "rec")

    def __init__(self, method: str, request, context, meta: dict[str, str] | None = None):
        self.method, self.request, self.context = method, request, context
        self.meta = meta if meta is not None else _metadata(context.invocation_metadata())
        self.rec: dict = {}

    async def __aenter__(self) -> dict:
        self.rec = RequestLogInterceptor._start(self.method, self.meta, self.request, self.context)
        if "x-request-id" in self.meta:
            await self.context.send_initial_metadata((("x-request-id", self.meta["x-request-id"]),))
        return self.rec

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                await _hide_unexpected(exc, self.context)
        finally:
            RequestLogInterceptor._end(self.rec, exc, self.context)
        return False


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs one line per finished RPC (INFO for Generate, DEBUG for the rest); echoes x-request-id. The RPCs in
    `own_records` (method paths) keep their own record and are left unwrapped."""

    def __init__(self, own_records: frozenset[str] = frozenset()):
        self.own_records = own_records

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        if details.method in self.own_records:
            return handler
        meta = _metadata(details.invocation_metadata)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, details.method, meta),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, details.method, meta),
                handler.request_deserializer, handler.response_serializer)
        return handler

    @staticmethod
    def _start(method: str, meta: dict, request, context) -> dict:
        rid = getattr(request, "request_id", "") or meta.get("x-request-id", "")
        rec = {"rpc": method, "request_id": rid, "peer": context.peer(), "start": time.monotonic()}
        _record.set(rec)
        return rec

    @staticmethod
    def _end(rec: dict, exc: BaseException | None, context) -> None:
        rec["status"] = _outcome(exc, context)
        rec["total_s"] = round(time.monotonic() - rec.pop("start"), 6)
        level = logging.INFO if rec["rpc"].endswith("/Generate") else logging.DEBUG
        if log.isEnabledFor(level):
            if rec["status"] != "OK":  # a client can repeat refused calls at will: a budget of lines for them
                if not FAILED_LINES.take():
                    return
                if left_out := FAILED_LINES.left_out():
                    rec["not_logged_before"] = left_out
            log.log(level, "request end", extra=rec)

    def _wrap_stream(self, fn, method: str, meta: dict):
        async def handler(request, context):
            async with RequestRecord(method, request, context, meta):
                async for msg in fn(request, context):
                    yield msg
        return handler

    def _wrap_unary(self, fn, method: str, meta: dict):
        async def handler(request, context):
            rec, exc = self._start(method, meta, request, context), None
            try:
                return await fn(request, context)
            except BaseException as e:
                exc = e
                await _hide_unexpected(e, context)
                raise
            finally:
                self._end(rec, exc, context)
        return handler
