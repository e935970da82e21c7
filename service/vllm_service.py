"""vllm.grpc.engine.VllmEngine: smg's vLLM worker protocol, served beside trtllm.TrtllmService on the shared looper.

The protocol comes from the `smg-grpc-proto` package (vLLM's own `smg-grpc-servicer` speaks the same). A worker that
serves both is detected by smg as vLLM (it tries sglang, vllm, trtllm in that order), which is why it is worth having:
smg leaves `temperature` and `max_tokens` unset when the client did (so `--default-max-new-tokens` and the model's
defaults apply), applies `GetModelInfo.default_sampling_params_json` to what a request leaves out, forwards `seed`,
and calls `Embed` for /v1/embeddings. Fields this executor cannot honour are refused with INVALID_ARGUMENT naming the
field, never ignored. Where the proto is silent this does what vLLM's servicer does: streamed chunks carry deltas
(token ids, counts, logprobs), the complete of a streamed sequence carries the last delta, the complete of an
unstreamed one every token; an output keeps its stop / EOS token (vLLM does; smg decodes with skip_special_tokens).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from tokenloop.core.request import OutputParams, StoppingParams, StructuredOutput, ValidRequest
from tokenloop.core.tokenizer import ModelCard
from tokenloop.looper.stream import Chunk, Complete
from tokenloop.v1 import tokenloop_pb2 as pb

from . import embedding
from .convert import SequenceWriter
from .errors import Unimplemented, ValidationError
from .frontdoor import FrontDoor, add_service, request_id_of, unary
from .structured import check_size
from .trtllm_convert import FINISH_REASONS
from .trtllm_service import TrtllmServicer, read_model_config, refuse, server_version
from .validation import MAX_TOP_LOGPROBS

log = logging.getLogger("tokenloop.service")
SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"]
SERVICE_NAME = SERVICE.full_name
GENERATE = f"/{SERVICE_NAME}/Generate"  # the RPC's gRPC path (the request log's `rpc`)
# FINISH_REASONS (trtllm_convert): vLLM's names too, length, stop (EOS, a stop string or token, a structure), abort
# Fields of GenerateRequest this executor cannot honour, and why (message fields: set when present).
UNSUPPORTED_REQUEST = {
    "mm_inputs": "multimodal inputs are not supported: this is a text-only model",
    "media_refs": "multimodal inputs are not supported: this is a text-only model",
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported by this executor",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported by this executor",
}
# generation_config.json key -> the key of `default_sampling_params_json` (vLLM's names)
INT32_MAX = 2**31 - 1
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _check_supported(request) -> None:
    """Refuse every field the executor cannot honour (INVALID_ARGUMENT naming the field)."""
    for name, why in UNSUPPORTED_REQUEST.items():
        if request.HasField(name):
            refuse(name, why)
    if request.extra_mm_inputs:
        refuse("extra_mm_inputs", UNSUPPORTED_REQUEST["mm_inputs"])
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        refuse("data_parallel_rank", "this worker has one data-parallel rank (0)")
    s = request.sampling_params
    if s.logit_bias:
        refuse("sampling_params.logit_bias", "logit biases are not supported by this executor")
    if s.HasField("prompt_logprobs"):
        refuse("sampling_params.prompt_logprobs", "prompt log probabilities are not computed by this executor")


def generation_defaults(card: ModelCard) -> dict:
    """The model's generation_config.json defaults (core.tokenizer.ModelCard.generation) under vLLM's names, as
    vLLM's servicer reports them in `default_sampling_params_json`: temperature, top_p, top_k, min_p,
    repetition_penalty and max_tokens where set."""
    return {GENERATION_DEFAULTS[key]: value for key, value in card.generation.items()}


def _sampling_message(s, defaults: dict) -> pb.SamplingParams:
    """vLLM SamplingParams -> tokenloop.v1 SamplingParams for the validator: what a request leaves unset takes the
    model's defaults (`defaults`, as GetModelInfo reports them), as smg does before it sends. proto3 cannot tell an
    unset `top_p`, `top_k` or `repetition_penalty` from 0: 0 means unset, as in vLLM's servicer. vLLM's `top_k` is a
    uint32 and ours an int32: a k past 2^31 - 1 keeps every token, so it is clamped to 2^31 - 1, which does the same."""
    top_k = min(s.top_k, INT32_MAX)  # no vocabulary is that large: a larger k keeps every token, as this one does
    msg = pb.SamplingParams(min_p=s.min_p, presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, top_k=top_k or defaults.get("top_k", 0))
    if s.HasField("temperature"):
        msg.temperature = s.temperature
    elif "temperature" in defaults:
        msg.temperature = defaults["temperature"]
    if s.top_p:
        msg.top_p = s.top_p
    elif "top_p" in defaults:
        msg.top_p = defaults["top_p"]
    if s.repetition_penalty:
        msg.repetition_penalty = s.repetition_penalty
    elif "repetition_penalty" in defaults:
        msg.repetition_penalty = defaults["repetition_penalty"]
    if not s.min_p and "min_p" in defaults:
        msg.min_p = defaults["min_p"]
    if s.HasField("seed"):
        msg.seed = s.seed & 0xFFFFFFFF  # int32 on the wire: a negative seed is its two's complement
    return msg


def structured_of_constraint(s, max_bytes: int) -> StructuredOutput | None:
    """vLLM `SamplingParams.constraint` (None when unset), checked but not compiled. `choice` becomes a Lark grammar
    of its alternatives (each a JSON string literal)."""
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    field = f"sampling_params.{kind}"
    if kind == "json_object":
        if not s.json_object:
            raise ValidationError("json_object_false", f"`{field}` must be true when set (leave it unset for free "
                                                       "text)")
        return StructuredOutput("json_object")
    if kind == "choice":
        choices = list(s.choice.choices)
        if not bool(choices):
            raise ValidationError("empty_structure", f"`{field}.choices` must not be empty")
        if not all(choices):
            raise ValidationError("empty_structure", f"`{field}.choices` must not hold an empty string")
        spec = "start: " + " | ".join(json.dumps(c) for c in choices)
        check_size(spec, f"{field}.choices", max_bytes)
        return StructuredOutput("grammar", spec)
    spec = getattr(s, kind)
    if not spec:
        raise ValidationError("empty_structure", f"`{field}` must not be empty")
    check_size(spec, field, max_bytes)
    return StructuredOutput(kind, spec)


def prompt_ids(validator, request) -> tuple[int, ...]:
    """The prompt's token ids: `tokenized.input_ids` (smg sends these), or `text` encoded as tokenloop.v1's `text`
    is; `sampling_params.truncate_prompt_tokens` keeps the last N (-1: the prompt limit), as vLLM does."""
    which = request.WhichOneof("input")
    if which is None:
        raise ValidationError("empty_input", "`input` must be set: one of `tokenized`, `text`")
    s = request.sampling_params
    keep = None
    if s.HasField("truncate_prompt_tokens"):
        keep = s.truncate_prompt_tokens
        if not (keep == -1 or keep >= 1):
            raise ValidationError("truncate_prompt_tokens",
                                  f"`sampling_params.truncate_prompt_tokens` must be >= 1, or -1 for the prompt limit; "
                                  f"got {keep}")
        keep = validator.limits.max_prompt_tokens if keep == -1 else keep
    if which == "text":
        ids, _ = validator.prompt(request)  # the `text` rules of tokenloop.v1 (same field name)
        return ids[-keep:] if keep else ids
    ids = request.tokenized.input_ids
    return validator.prompt_ids(ids[-keep:] if keep else ids, "tokenized.input_ids")


def to_valid_request(validator, request, request_id: str, deadline: float | None,
                     defaults: dict | None = None) -> ValidRequest:
    """Validate a vLLM `GenerateRequest` with the server's limits; errors name THEIR proto's fields. An unset
    `max_tokens` is `--default-max-new-tokens` (capped by the context left); `defaults` are the model's sampling
    defaults (`generation_defaults`) for the fields the request leaves unset."""
    _check_supported(request)
    defaults = defaults or {}
    lim, s = validator.limits, request.sampling_params
    n = s.n or 1
    if n > lim.max_n:
        raise ValidationError("n", f"`sampling_params.n` must be between 1 and {lim.max_n}; got {n}")
    top = s.logprobs if s.HasField("logprobs") else 0
    if not (0 <= top <= MAX_TOP_LOGPROBS):
        raise ValidationError("top_logprobs",
                              f"`sampling_params.logprobs` must be between 0 and {MAX_TOP_LOGPROBS}; got {top}"
                              + (" (-1, every token of the vocabulary, is not supported)" if top == -1 else ""))
    validator.stop_lists(s.stop, s.stop_token_ids, "sampling_params.")  # before tokenizing
    structured = structured_of_constraint(s, lim.max_grammar_bytes)
    ids = prompt_ids(validator, request)
    max_new = validator.new_token_limits(s.max_tokens if s.HasField("max_tokens") else None, s.min_tokens,
                                         len(ids), "sampling_params.max_tokens", "sampling_params.min_tokens")
    stopping = StoppingParams(max_new_tokens=max_new, min_new_tokens=s.min_tokens, stop=tuple(s.stop),
                              stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                              include_stop_str_in_output=s.include_stop_str_in_output)
    validator.check_min_new_tokens(stopping, "sampling_params.stop_token_ids", "sampling_params.min_tokens")
    return ValidRequest(
        request_id=validator.request_id(request_id), prompt_token_ids=ids,
        sampling=validator.sampling_from(_sampling_message(s, defaults), "sampling_params."), stopping=stopping,
        output=OutputParams(logprobs=s.HasField("logprobs"), top_logprobs=top,
                            skip_special_tokens=s.skip_special_tokens),
        n=n, stream=request.stream, deadline=deadline, structured=structured)


def _output_logprobs(items, top: int) -> vpb.OutputLogProbs | None:
    """vLLM's OutputLogProbs of `items` (core TokenLogprob): the chosen token's logprob per position and, when
    `sampling_params.logprobs` > 0, its top alternatives. None when there are none."""
    if not items:
        return None
    out = vpb.OutputLogProbs(token_logprobs=[lp.logprob for lp in items], token_ids=[lp.token_id for lp in items])
    if top:
        out.top_logprobs.extend(vpb.TopLogProbs(values=[p for _, p in lp.top], token_ids=[t for t, _ in lp.top])
                                for lp in items)
    return out


class VllmWriter(SequenceWriter):
    """vLLM GenerateResponse messages (convert.SequenceWriter holds, merges and paces the chunks).

    Streaming: a sequence's ready tokens go out as one delta chunk, and its end as a complete carrying the last
    delta, as vLLM's servicer sends it. Not streaming: no chunks; one complete per sequence with every token.
    """

    __slots__ = ("_last",)

    def __init__(self, valid: ValidRequest, interval: int = 1):
        super().__init__(valid, interval)
        self._last: dict[int, Chunk] = {}  # sequence index -> its final chunk, for its complete

    def encode_chunk(self, chunk: Chunk, done: Complete | None) -> bytes | None:
        if not self.valid.stream:
            return None
        if done is not None:
            self._last[chunk.index] = chunk
        msg = vpb.GenerateResponse()
        out = msg.chunk
        out.token_ids.extend(chunk.token_ids)
        out.prompt_tokens = len(self.valid.prompt_token_ids)
        out.completion_tokens = len(chunk.token_ids)  # a delta count, as vLLM sends it (smg adds them up)
        out.cached_tokens = chunk.cached_prompt_tokens
        out.index = chunk.index
        lps = _output_logprobs(chunk.logprobs, self.valid.output.top_logprobs)
        if lps is not None:
            out.output_logprobs.CopyFrom(lps)
        return msg.SerializeToString()

    def encode_complete(self, done: Complete) -> bytes:
        if self.valid.stream:  # the last delta
            last = self._last.pop(done.index, None)
            ids, lps = (last.token_ids, last.logprobs) if last is not None else ([], None)
        else:
            ids, lps = done.token_ids, done.logprobs
        msg = vpb.GenerateComplete(
            output_ids=ids, finish_reason=FINISH_REASONS[done.finish_reason], prompt_tokens=done.prompt_tokens,
            completion_tokens=len(ids), cached_tokens=done.cached_prompt_tokens, index=done.index,
            spec_draft_tokens=done.draft_tokens, spec_accepted_tokens=done.accepted_draft_tokens)  # speculation
        out_lps = _output_logprobs(lps, self.valid.output.top_logprobs)
        if out_lps is not None:
            msg.output_logprobs.CopyFrom(out_lps)
        if done.matched_stop_str is not None:
            msg.matched_stop_str = done.matched_stop_str
        elif done.matched_stop_token is not None:
            msg.matched_token_id = done.matched_stop_token
        return vpb.GenerateResponse(complete=msg).SerializeToString()


class VllmServicer(vpb_grpc.VllmEngineServicer):
    """The vllm.grpc.engine.VllmEngine RPCs on the App shared with tokenloop.v1 and trtllm.TrtllmService."""

    # The same tokenizer bundle and KV-event hub as trtllm.TrtllmService (the messages are smg's common ones).
    GetTokenizer = TrtllmServicer.GetTokenizer
    SubscribeKvEvents = TrtllmServicer.SubscribeKvEvents

    def __init__(self, app):
        self.app = app  # service.app.App
        self._bundle: bytes | None = None  # GetTokenizer's zip (TrtllmServicer.GetTokenizer)
        self._defaults: dict | None = None  # generation_defaults of the model, read once
        self._started = time.time()
        self._last_receive = 0.0
        self.Generate = FrontDoor(app, GENERATE, self._validate, self._writer).generate

    def defaults(self) -> dict:
        if self._defaults is None:
            self._defaults = generation_defaults(self.app.card)
        return self._defaults

    async def _validate(self, request, request_id: str, deadline: float | None) -> ValidRequest:
        """The front door's mapping step: the request validated, its constraint compiled (errors name its field)."""
        self._last_receive = time.time()
        valid = to_valid_request(self.app.validator, request, request_id, deadline, self.defaults())
        if valid.structured is not None:
            kind = request.sampling_params.WhichOneof("constraint")
            valid = await self.app.grammars.admit(valid, f"sampling_params.{kind}")
        return valid

    def _writer(self, valid: ValidRequest, request, arrival_wall: float) -> VllmWriter:
        return VllmWriter(valid, getattr(self.app.config, "stream_interval", 1))

    @unary()
    async def Embed(self, request, context):
        """The prompt's pooled final hidden state (service.embedding, the helper tokenloop.v1 Embed calls too): the
        executor's default pooling and normalization (--embed-pooling, --embed-normalize, the model's config)."""
        done = await embedding.embed(self.app, context, request_id_of(request, context), request.tokenized.input_ids,
                                     field="tokenized.input_ids")
        if done is None:
            return None  # the client went away
        return vpb.EmbedResponse(embedding=done.vector, prompt_tokens=done.prompt_tokens,
                                 embedding_dim=len(done.vector))

    @unary(ready=False)  # flush_cache: UNAVAILABLE while not ready, UNIMPLEMENTED without a prefix cache
    async def FlushCache(self, request, context):
        """Drop the prefix cache's unused blocks (blocks in use stay: no need to wait `timeout_s` for idleness)."""
        dropped = await embedding.flush_cache(self.app)
        return common_pb2.FlushCacheResponse(
            success=True, message=f"dropped {dropped} unused prefix-cache block{'s' if dropped != 1 else ''}")

    @unary(ready=False)
    async def StartProfile(self, request, context):
        raise Unimplemented("StartProfile is not supported: this worker has no profiler")

    @unary(ready=False)
    async def StopProfile(self, request, context):
        raise Unimplemented("StopProfile is not supported: this worker has no profiler")

    @unary(ready=False)
    async def HealthCheck(self, request, context):
        """As vLLM's servicer: an answer either way (so smg's detection finds this protocol while the model loads),
        `healthy` false while loading, draining, or after the executor died."""
        reason = self.app.not_ready_reason
        return vpb.HealthCheckResponse(healthy=not reason, message=reason or "Healthy")

    @unary(ready=False)
    async def Abort(self, request, context):
        app = self.app
        for rid in request.request_ids:
            if not (app.admission.abort(rid) or (app.looper is not None and app.looper.abort(rid))):
                log.debug("Abort %r: not in flight", rid)
        return vpb.AbortResponse()

    @unary()
    async def GetModelInfo(self, request, context):
        return self.model_info()

    def model_info(self) -> vpb.GetModelInfoResponse:
        app = self.app
        card, cfg, defaults = app.card, read_model_config(app.config.model), self.defaults()
        return vpb.GetModelInfoResponse(
            model_path=str(app.config.model), is_generation=True, max_context_length=card.max_context_length,
            vocab_size=app.validator.vocab_size, supports_vision=False, served_model_name=card.model_id,
            tokenizer_path=str(app.config.model), model_type=str(cfg.get("model_type", "")),
            architectures=cfg.get("architectures") or [card.architecture], eos_token_ids=card.eos_token_ids,
            pad_token_id=int(cfg.get("pad_token_id") or 0), bos_token_id=card.bos_token_id or 0,
            max_req_input_len=app.validator.limits.max_prompt_tokens,
            default_sampling_params_json=json.dumps(defaults, separators=(",", ":")) if defaults else "")

    @unary(ready=False)
    async def GetServerInfo(self, request, context):
        app = self.app
        info = vpb.GetServerInfoResponse(
            active_requests=app.looper.num_open if app.looper is not None else 0,
            last_receive_timestamp=self._last_receive, uptime_seconds=time.time() - self._started,
            server_type="tokenloop", data_parallel_size=1, max_num_seqs=app.config.max_concurrent_requests)
        if app.card is not None:
            info.model_dtype = app.dtype
            info.kv_cache_dtype = app.dtype
        if app.executor is not None:
            info.block_size = app.executor.stats().tokens_per_block
        return info

    @unary(ready=False)
    async def GetLoads(self, request, context):
        """One rank's load (`App.load`, what tokenloop.v1 GetLoad and the KV-event stream's `load` report)."""
        load = self.app.load()
        block = load.kv_block_size
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(), version=server_version(), dp_rank_count=1,
            loads=[vpb.SchedulerLoad(
                dp_rank=0, num_running_reqs=load.num_running, num_waiting_reqs=load.num_waiting,
                num_total_reqs=load.num_running + load.num_waiting, num_used_tokens=load.kv_blocks_used * block,
                max_total_num_tokens=load.kv_blocks_total * block, token_usage=load.kv_cache_utilization,
                cache_hit_rate=load.prefix_cache_hit_rate, max_running_requests=load.max_concurrent_requests)])


def add_vllm_service(app, grpc_server) -> str:
    """Register vllm.grpc.engine.VllmEngine on `grpc_server`, Generate yielding serialized messages
    (`VllmWriter.encode`); returns its full name (for reflection)."""
    add_service(grpc_server, VllmServicer(app), SERVICE, raw_responses="Generate")
    return SERVICE_NAME
