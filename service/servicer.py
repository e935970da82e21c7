"""tokenloop.v1.TextGeneration: the public RPCs, on the shared looper."""

from __future__ import annotations

import time
import uuid

import grpc

from tokenloop.looper.stream import Complete, RequestFailed
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

from . import convert
from .errors import AlreadyExists, ServiceError, ValidationError, abort_with, status_of


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    """Validates at the door, admits, submits to the looper, streams events back."""

    def __init__(self, app):
        self.app = app  # service.app.App

    async def Generate(self, request, context):
        app, arrival = self.app, time.monotonic()
        rid = request.request_id or metadata_value(context, "x-request-id") or uuid.uuid4().hex
        completes: list[Complete] = []
        code = grpc.StatusCode.OK
        try:
            app.require_ready()
            async with app.admission.slot():
                valid = app.validator.generate(request, rid, deadline_of(context))
                if app.looper.find(rid) is not None:
                    raise AlreadyExists(f"`request_id` {rid!r} is already in flight")
                stream = app.looper.submit(valid, arrival)
                try:
                    async for batch in stream.batches():
                        for msg in convert.messages(valid, batch):
                            yield msg
                        completes += [e for e in batch if isinstance(e, Complete)]
                finally:
                    if not stream.finished:
                        stream.cancel()  # client gone, deadline, or server abort
                    app.observe_end(valid, completes, code)
        except (ServiceError, RequestFailed) as exc:
            code = status_of(exc)[0]
            app.observe_error(code)
            await abort_with(context, exc)

    async def Tokenize(self, request, context):
        try:
            self.app.require_ready()
            validator = self.app.validator
            which = request.WhichOneof("input")
            text = validator.render_chat(request.chat) if which == "chat" else request.text
            tok = self.app.tokenizer
            ids = tok.encode(text, add_special_tokens=tok.add_bos)
            return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids],
                                       text=text if which == "chat" else "")
        except ServiceError as exc:
            await abort_with(context, exc)

    async def Detokenize(self, request, context):
        try:
            self.app.require_ready()
            vocab = self.app.validator.vocab_size
            bad = next((t for t in request.token_ids if t >= vocab), None)
            if bad is not None:
                raise ValidationError("token_id_out_of_range",
                                      f"`token_ids` must be < the vocabulary size {vocab}; got {bad}")
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            return pb.DetokenizeResponse(text=self.app.tokenizer.decode(request.token_ids, skip))
        except ServiceError as exc:
            await abort_with(context, exc)

    async def GetModelInfo(self, request, context):
        try:
            self.app.require_ready()
            return self.app.model_info()
        except ServiceError as exc:
            await abort_with(context, exc)

    async def GetLoad(self, request, context):
        return self.app.load()

    async def Abort(self, request, context):
        try:
            self.app.require_ready()
            return pb.AbortResponse(found=self.app.looper.abort(request.request_id))
        except ServiceError as exc:
            await abort_with(context, exc)
