"""tokenloop.v1.TextGeneration: the public RPCs, on the shared looper."""

from __future__ import annotations

import logging

from tokenloop.core.request import ValidRequest
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

from . import convert, embedding
from .errors import ValidationError
from .frontdoor import FrontDoor, add_service, request_id_of, unary
from .validation import text_size

log = logging.getLogger("tokenloop.service")
SERVICE = pb.DESCRIPTOR.services_by_name["TextGeneration"]
GENERATE = f"/{SERVICE.full_name}/Generate"  # the RPC's gRPC path


def add_text_generation(servicer: TextGenerationServicer, server) -> None:
    """tokenloop.v1.TextGeneration, with Generate yielding serialized messages (`StreamWriter.encode`)."""
    add_service(server, servicer, SERVICE, raw_responses="Generate")


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    """tokenloop.v1's mapping: its messages into a ValidRequest (service.validation) and events out
    (convert.StreamWriter); the front door (service.frontdoor) admits, submits and streams."""

    def __init__(self, app):
        self.app = app  # service.app.App
        self.Generate = FrontDoor(app, GENERATE, self._validate, self._writer).generate

    async def _validate(self, request, request_id: str, deadline: float | None) -> ValidRequest:
        app = self.app
        return await app.tokenizing(text_size(request), app.validator.generate, request, request_id, deadline)

    def _writer(self, valid: ValidRequest, request, arrival_wall: float) -> convert.StreamWriter:
        return convert.StreamWriter(valid, self.app.config.stream_interval, self.app.config.coalesce)

    @unary()
    async def Tokenize(self, request, context):
        return await self.app.tokenizing(text_size(request), self._tokenize, request)

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
        validator.check_prompt_length(len(ids), which or "text")
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, text=text if which == "chat" else "")

    @unary()
    async def Detokenize(self, request, context):
        self.app.validator.detokenize_ids(request.token_ids)  # how many, then their range
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.app.tokenizing(len(request.token_ids), self.app.tokenizer.decode, request.token_ids, skip)
        return pb.DetokenizeResponse(text=text)

    @unary()
    async def GetModelInfo(self, request, context):
        return self.app.model_info()

    @unary()
    async def LoadLoraAdapter(self, request, context):
        loras = self.app.loras
        adapter_id = request.id if request.HasField("id") else None
        adapter = await loras.load_at_run_time(request.name, request.path, adapter_id)
        log.info("LoRA adapter %s loaded from %s (id %d, rank %d)", adapter.name, adapter.path, adapter.id,
                 adapter.rank)
        return loras.describe(adapter)

    @unary()
    async def UnloadLoraAdapter(self, request, context):
        adapter = await self.app.loras.unload(request.name)
        log.info("LoRA adapter %s unloaded", adapter.name)
        return pb.UnloadLoraAdapterResponse(adapter=self.app.loras.describe(adapter))

    @unary()
    async def ListLoraAdapters(self, request, context):
        loras = self.app.loras
        return pb.ListLoraAdaptersResponse(adapters=[loras.describe(a) for a in loras.list()])

    @unary(ready=False)
    async def GetLoad(self, request, context):
        return self.app.load()

    @unary()
    async def Abort(self, request, context):
        rid = request.request_id
        return pb.AbortResponse(found=self.app.admission.abort(rid) or self.app.looper.abort(rid))

    @unary()
    async def Embed(self, request, context):
        """The prompt's embedding through service.embedding.embed (the path smg's vLLM Embed takes too)."""
        app = self.app
        pooling = embedding.pooling_of(request.pooling, pb.Pooling)
        normalize = request.normalize if request.HasField("normalize") else None
        if request.WhichOneof("input") is None:
            raise ValidationError("empty_input", "`input` must be set: one of `text`, `token_ids`")
        embedding.embed_params(app, pooling, normalize)  # UNIMPLEMENTED before tokenizing, on an executor without
        ids, _ = await app.tokenizing(text_size(request), app.validator.prompt, request)
        rid = request_id_of(request, context)
        result = await embedding.embed(app, context, rid, ids, pooling, normalize,
                                       field="token_ids.ids" if request.HasField("token_ids") else "text")
        if result is None:
            return None  # the client went away
        return pb.EmbedResponse(request_id=rid, embedding=result.vector, prompt_tokens=result.prompt_tokens,
                                pooling=pb.Pooling.Value(result.pooling.upper()), normalized=result.normalized)
