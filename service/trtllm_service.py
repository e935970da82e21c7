"""trtllm.TrtllmService: the worker API the Shepherd Model Gateway (SMG) routes to, on the shared looper.

The protocol comes from the `smg-grpc-proto` package (TensorRT-LLM's `trtllm-serve --grpc` speaks the
same): token ids in, delta token ids out in `chunk` messages, then one `complete` per sequence.
Fields this executor cannot honour are refused with INVALID_ARGUMENT naming the field, never ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import zipfile
from pathlib import Path

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tokenloop.core.gguf_file import is_gguf
from tokenloop.core.kv_events import ResumeOutOfRange
from tokenloop.core.request import OutputParams, StoppingParams, ValidRequest
from tokenloop.core.tokenizer import Tokenizer

from .errors import (
    DataLoss,
    OutOfRange,
    Unimplemented,
    ValidationError,
    abort_with,
)
from .frontdoor import FrontDoor, add_service, unary
from .kv_events import FellBehind, kv_event_stream
from .structured import structured_of_guided
from .trtllm_convert import TrtllmWriter
from .validation import MAX_TOP_LOGPROBS

log = logging.getLogger("tokenloop.service")
SERVICE = tpb.DESCRIPTOR.services_by_name["TrtllmService"]
SERVICE_NAME = SERVICE.full_name
GENERATE = f"/{SERVICE_NAME}/Generate"  # the RPC's gRPC path (the request log's `rpc`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json", "config.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
TOKENIZER_CHUNK_BYTES = 1 << 20
# Fields of GenerateRequest / SamplingConfig / OutputConfig this executor cannot honour, and why.
UNSUPPORTED_REQUEST = {
    "prompt_tuning_config": "prompt tuning is not supported by this executor",
    "multimodal_input": "multimodal inputs are not supported: this is a text-only model",
    "disaggregated_params": "disaggregated (prefill/decode) serving is not supported by this executor",
    "lookahead_config": "lookahead decoding is not supported by this executor",
    "kv_cache_retention": "KV-cache retention policies are not supported by this executor",
    "cache_salt_id": "cache salts are not supported by this executor",
}
UNSUPPORTED_SAMPLING = ("top_p_min", "top_p_reset_ids", "top_p_decay", "beam_search_diversity_rate",
                        "prompt_ignore_length", "length_penalty", "early_stopping", "no_repeat_ngram_size")


def refuse(field: str, why: str) -> None:
    raise ValidationError("unsupported_field", f"`{field}` cannot be honoured: {why}")


def check_supported(request) -> None:
    """Refuse every field the executor cannot honour (INVALID_ARGUMENT naming the field)."""
    for name, why in UNSUPPORTED_REQUEST.items():
        if request.HasField(name):
            refuse(name, why)
    if request.embedding_bias:
        refuse("embedding_bias", "logit biases are not supported by this executor")
    if request.bad or request.bad_token_ids:
        refuse("bad" if request.bad else "bad_token_ids", "the executor cannot ban words or tokens")
    if request.tokenized.query_token_ids:
        refuse("tokenized.query_token_ids", "star attention is not supported by this executor")
    s = request.sampling_config
    if s.beam_width < 0:
        raise ValidationError("beam_width",
                              f"`sampling_config.beam_width` must be >= 1 (0, unset, means 1); got {s.beam_width}")
    if s.beam_width > 1 or s.beam_width_array:
        refuse(f"sampling_config.beam_width{'_array' if s.beam_width_array else ''}",
               "beam search is not supported by this executor")
    for name in UNSUPPORTED_SAMPLING:
        if s.HasField(name):
            refuse(f"sampling_config.{name}", "this executor does not implement it")
    o = request.output_config
    if o.HasField("prompt_logprobs"):
        refuse("output_config.prompt_logprobs", "prompt log probabilities are not computed by this executor")
    for name in ("return_context_logits", "return_generation_logits", "return_encoder_output"):
        if getattr(o, name):
            refuse(f"output_config.{name}", "this executor does not return raw logits or encoder outputs")


def _stopping(validator, request, num_prompt: int) -> StoppingParams:
    min_new = request.sampling_config.min_tokens
    max_new = validator.new_token_limits(request.max_tokens or None, min_new, num_prompt, "max_tokens",
                                         "sampling_config.min_tokens")  # max_tokens 0: unset
    validator.stop_lists(request.stop, request.stop_token_ids, "")
    params = StoppingParams(max_new_tokens=max_new, min_new_tokens=min_new, stop=tuple(request.stop),
                            stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos)
    validator.check_min_new_tokens(params, "stop_token_ids", "sampling_config.min_tokens")
    return params


def lora_name(request, catalog) -> str:
    """The adapter `lora_config.task_id` names (a loaded adapter's id); "" without `lora_config`. Weights or a config
    in the request are refused: adapters are loaded by the operator (`--lora`, `LoadLoraAdapter`), not per request."""
    if not request.HasField("lora_config"):
        return ""
    lc = request.lora_config
    if lc.weights or lc.config_json:
        refuse("lora_config.weights" if lc.weights else "lora_config.config_json", "load the adapter on the worker (`--lora`, LoadLoraAdapter) and send its "
                "`task_id` only")
    if catalog is None or not catalog.supported:
        refuse("lora_config", "LoRA adapters are not supported by this executor")
    return catalog.name_of_task(lc.task_id)


def to_valid_request(validator, request, request_id: str, deadline: float | None,
                     lora_catalog=None) -> ValidRequest:
    """Validate a trtllm `GenerateRequest` with the server's limits; errors name THEIR proto's fields."""
    check_supported(request)
    lim = validator.limits
    n = request.sampling_config.num_return_sequences or 1
    if n > lim.max_n:
        raise ValidationError("n", f"`sampling_config.num_return_sequences` must be between 1 and {lim.max_n}; got {n}")
    ids = validator.prompt_ids(request.tokenized.input_token_ids, "tokenized.input_token_ids")
    o = request.output_config
    top = o.logprobs if o.HasField("logprobs") else 0
    if not (0 <= top <= MAX_TOP_LOGPROBS):
        raise ValidationError("top_logprobs",
                              f"`output_config.logprobs` must be between 0 and {MAX_TOP_LOGPROBS}; got {top}")
    return ValidRequest(
        request_id=validator.request_id(request_id), prompt_token_ids=ids,
        sampling=validator.sampling_from(request.sampling_config, "sampling_config."), stopping=_stopping(validator, request, len(ids)),
        output=OutputParams(logprobs=o.HasField("logprobs"), top_logprobs=top), n=n, stream=request.streaming,
        deadline=deadline, structured=structured_of_guided(request, lim.max_grammar_bytes),
        lora=lora_name(request, lora_catalog))


def tokenizer_bundle(model_dir: str | Path) -> bytes:
    """A zip of the model directory's tokenizer files (fixed timestamps, so the same files give the same bytes). For
    a GGUF file, the tokenizer its metadata holds (core/gguf_tokenizer.py), written as tokenizer.json,
    tokenizer_config.json (BOS / EOS tokens, whether BOS is added, the chat template) and chat_template.jinja: what a
    router that takes the worker's tokenizer (smg with a --model-path that does not exist) loads."""
    if is_gguf(model_dir):
        tok = Tokenizer.from_dir(model_dir)
        config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
                  "chat_template": tok.chat_template}
        files = {"tokenizer.json": tok.to_json().encode(), "tokenizer_config.json": json.dumps(config).encode()}
        if tok.chat_template:  # also as its own file, where transformers 4.43+ writes it and routers look for it
            files["chat_template.jinja"] = tok.chat_template.encode()
    else:
        files = {name: (Path(model_dir) / name).read_bytes() for name in TOKENIZER_FILES
                 if (Path(model_dir) / name).is_file()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data, compress_type=zipfile.ZIP_DEFLATED)
    return buf.getvalue()


class TrtllmServicer(tpb_grpc.TrtllmServiceServicer):
    """The trtllm.TrtllmService RPCs on the App shared with tokenloop.v1."""

    def __init__(self, app):
        self.app = app  # service.app.App
        self._bundle: bytes | None = None
        self.Generate = FrontDoor(app, GENERATE, self._validate, self._writer,
                                  grammar_field="guided_decoding.guide").generate

    async def _validate(self, request, request_id: str, deadline: float | None) -> ValidRequest:
        return to_valid_request(self.app.validator, request, request_id, deadline, self.app.loras)

    def _writer(self, valid: ValidRequest, request, arrival_wall: float) -> TrtllmWriter:
        return TrtllmWriter(valid, request.include_stop_token_in_output, request.output_config.return_perf_metrics,
                       arrival_wall, getattr(self.app.config, "stream_interval", 1))

    async def Embed(self, request, context):
        await abort_with(context, Unimplemented(
            "Embed is not available: this server runs a generative model (use Generate)"))

    @unary()  # loading, draining, or the executor died: UNAVAILABLE
    async def HealthCheck(self, request, context):
        return tpb.HealthCheckResponse(status="OK")

    @unary(ready=False)
    async def Abort(self, request, context):
        looper, rid = self.app.looper, request.request_id
        found = self.app.admission.abort(rid) or (looper is not None and looper.abort(rid))
        return tpb.AbortResponse(success=found, message=f"request {request.request_id!r} "
                                 + ("aborted" if found else "not in flight (already finished, aborted or unknown)"))

    @unary()
    async def GetModelInfo(self, request, context):
        return self.model_info()

    def model_info(self) -> tpb.GetModelInfoResponse:
        app = self.app
        cfg = read_model_config(app.config.model)
        features = ["stop", "stop_token_ids", "ignore_eos", "logprobs", "num_return_sequences", "seed",
                    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "guided_decoding"]
        return tpb.GetModelInfoResponse(
            model_id=app.card.model_id, max_input_len=app.validator.limits.max_prompt_tokens,
            max_seq_len=app.card.max_context_length, max_batch_size=app.config.max_concurrent_requests,
            vocab_size=app.validator.vocab_size, hidden_size=int(cfg.get("hidden_size", 0)),
            num_layers=int(cfg.get("num_hidden_layers", 0)), num_heads=int(cfg.get("num_attention_heads", 0)),
            supported_features=features)

    @unary(ready=False)
    async def GetServerInfo(self, request, context):
        opts = self.app.config.executor_options
        tp, pp = int(opts.get("tensor_parallel_size") or 1), int(opts.get("pipeline_parallel_size") or 1)
        return tpb.GetServerInfoResponse(
            version=server_version(), backend="tensorrt" if self.app.config.backend == "trtllm" else "pytorch",
            tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=1, world_size=tp * pp)

    @unary(ready=False)
    async def GetTokenizer(self, request, context):
        if self._bundle is None:
            self._bundle = await asyncio.to_thread(tokenizer_bundle, self.app.config.model)
        data = self._bundle
        if not data or len(data) <= 22:  # an empty zip is 22 bytes
            await abort_with(context, Unimplemented(f"no tokenizer files in {self.app.config.model}"))
            return
        step = max(1024, min(TOKENIZER_CHUNK_BYTES, self.app.config.max_message_bytes // 2))
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), step):
            last = start + step >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + step], sha256=digest if last else "")

    @unary()
    async def SubscribeKvEvents(self, request, context):
        app = self.app
        hub = app.capabilities.kv_events
        if hub is None:
            raise Unimplemented("SubscribeKvEvents is not available: this executor publishes no KV-cache events "
                                "(routers fall back to load-based routing)")
        try:
            async for msg in kv_event_stream(app, hub, request, app.config.kv_events_heartbeat, context.peer()):
                yield msg
        except ResumeOutOfRange as exc:
            raise OutOfRange(str(exc)) from exc
        except FellBehind as exc:
            raise DataLoss(str(exc)) from exc


def read_model_config(model_dir: str) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"tokenloop {version('tokenloop')}"
    except PackageNotFoundError:
        return "tokenloop"


def add_trtllm_service(app, grpc_server) -> str:
    """Register trtllm.TrtllmService on `grpc_server`, Generate yielding serialized messages (`TrtllmWriter.encode`);
    returns its full name (for reflection)."""
    add_service(grpc_server, TrtllmServicer(app), SERVICE, raw_responses="Generate")
    return SERVICE_NAME
