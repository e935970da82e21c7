"""`tokenloop serve ...`: the server's command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from importlib.metadata import PackageNotFoundError, version

from tokenloop.core.gguf_file import GGUFError, is_gguf, open_gguf

from .config import DEFAULT_MODEL_DIR, ServerConfig, parse_lookahead_flag
from .logs import setup_logging
from .startup import StartupError, check_startup

# flags handed to the executor factory as keyword arguments when given
ENGINE_FLAGS = ("kv_cache_tokens", "kv_cache_memory_fraction", "max_num_tokens", "max_batch_size", "dtype",
                "num_threads", "block_size", "enable_prefix_caching", "attention_backend", "matmul_backend", "weights",
                "max_lora_rank", "embed_pooling", "embed_normalize", "speculative", "num_speculative_tokens",
                "speculative_max_batch_size", "route_retiming", "kv_dtype")
TRTLLM_FLAGS = ("trtllm_api", "kv_cache_free_gpu_memory_fraction", "enable_block_reuse", "enable_chunked_context",
                "scheduler_policy", "tensor_parallel_size", "pipeline_parallel_size", "beam_width",
                "max_batch_size", "max_num_tokens", "guided_decoding_backend", "kv_event_buffer_max_size",
                "max_lora_rank", "speculative", "num_speculative_tokens", "speculative_max_batch_size",
                "speculative_model", "lookahead_config")


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's default shown once (not where its help already says it, nor when there is none), and short
    placeholders (N, X, VALUE) instead of the flag's name in capitals."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default in ("", [],
                                                                                                      argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X"}.get(action.type, "VALUE")


def _lookahead(value: str) -> tuple[int, int, int]:
    try:
        return parse_lookahead_flag(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version() -> str:
    try:
        return version("tokenloop")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloop", description="gRPC text-generation worker",
                                     epilog="`tokenloop serve --help` for the server's flags; docs/server.md")
    parser.add_argument("-V", "--version", action="version", version=f"tokenloop {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="serve")
    s = sub.add_parser("serve", help="serve a model over gRPC", formatter_class=_HelpFormatter,
                       usage="tokenloop serve [--model DIR] [--host HOST] [--port N] [options]",
                       description="Serve a model over gRPC. Flags by group below; docs/server.md has them all "
                                   "(security, logs and deployment: docs/operations.md).")
    d = ServerConfig()
    s.add_argument("--model", default=None, help=f"checkpoint directory or GGUF file (default: {DEFAULT_MODEL_DIR}, made by `make model`)")
    s.add_argument("--backend", choices=("engine", "trtllm"), default=d.backend,
                   help="engine: the embedded PyTorch engine (CPU); trtllm: TensorRT-LLM on a GPU (docs/trtllm.md)")
    s.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=d.port, help="gRPC port (0: a free one, logged at start-up)")
    s.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0: off)")
    s.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="requests generating at once; more wait in the queue (--max-queue)")
    s.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot before RESOURCE_EXHAUSTED")
    s.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace, help="seconds to finish in-flight requests on SIGTERM")
    s.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="largest max_new_tokens accepted")
    s.add_argument("--default-max-new-tokens", type=int, default=None,
                   help=f"max_new_tokens of a request that gives none (default: {d.default_max_new_tokens}, or "
                        "--max-new-tokens when that is smaller)")
    s.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="0: the model's context minus one")
    s.add_argument("--max-n", type=int, default=d.max_n, help="most sequences one request may ask for (n)")
    s.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="largest gRPC message received")
    s.add_argument("--kv-events-heartbeat", type=float, default=d.kv_events_heartbeat,
                   help="SubscribeKvEvents: seconds between load-only batches while the engine is idle")
    s.add_argument("--router-protocol", choices=("both", "vllm", "trtllm"), default=d.router_protocol,
                   help="smg's worker protocols served beside tokenloop.v1: vllm.grpc.engine.VllmEngine, "
                        "trtllm.TrtllmService, or both (smg then detects vLLM; docs/router.md)")
    s.add_argument("--stall-timeout", type=float, default=d.stall_timeout,
                   help="abort a stream whose reader stopped reading for this long (0: never)")
    s.add_argument("--slow-reader-grace", type=float, default=d.slow_reader_grace,
                   help="a stream whose reader stopped reading for this long gives back its admission slot and its "
                        "generation is paused (KV freed) until it reads again (0: off; needs an executor that can "
                        "pause: the embedded engine)")
    s.add_argument("--max-queue-wait", type=float, default=d.max_queue_wait,
                   help="seconds a request may wait for an admission slot before RESOURCE_EXHAUSTED (0: no bound)")
    s.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="send a sequence's tokens at most every N tokens while the reader keeps up "
                        "(a reader that fell behind gets all ready tokens in one message)")
    s.add_argument("--tokenize-inline-chars", type=int, default=d.tokenize_inline_chars,
                   help="tokenize longer texts (and chats) on a worker thread, so that the event loop keeps serving "
                        "(0: every one)")
    s.add_argument("--front-cpu", default=d.front_cpu, metavar="{auto,off,N}",
                   help="the CPU that the event-loop thread and the looper thread share (they take turns on the GIL); "
                        "auto: the one the server starts on, given two CPUs or more; off: the OS places them")
    s.add_argument("--model-id", default="", help="name reported by GetModelInfo (default: the directory's name)")
    s.add_argument("--log-level", default=d.log_level, choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity")
    s.add_argument("--log-format", default=d.log_format, choices=("text", "json"),
                   help="json: one JSON object per line, including one line per finished request")
    for name, what in (("max_stop_strings", "most stop strings in one request"),
                       ("max_stop_string_length", "longest stop string, in characters"),
                       ("max_stop_token_ids", "most stop_token_ids one request may list (every API)"),
                       ("max_detokenize_ids", "most token ids one Detokenize call may send (0: the model's context)")):
        s.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=what)
    s.add_argument("--allow-special-tokens-in-chat", action="store_true",
                   help="encode special-token text in chat message content as the special tokens (default: as text, "
                        "so that a user cannot open a system turn)")
    g = s.add_argument_group("structured output (docs/structured-output.md)")
    g.add_argument("--max-grammar-bytes", type=int, default=d.max_grammar_bytes,
                   help="largest JSON schema, regex, grammar or structural tag a request may carry")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                   help="seconds a constraint may take to compile before its request is refused")
    g.add_argument("--grammar-cache-size", type=int, default=d.grammar_cache_size,
                   help="compiled constraints kept, most recently used first (0: none)")
    g.add_argument("--grammar-compile-workers", type=int, default=d.grammar_compile_workers,
                   help="compile processes (one killed and replaced at a compile's timeout), and as many threads")
    g.add_argument("--max-grammar-compiles-waiting", type=int, default=d.max_grammar_compiles_waiting,
                   help="compiles waiting for a compile process; more are refused with RESOURCE_EXHAUSTED")
    lo = s.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                    help="serve the PEFT adapter in DIR as NAME (repeatable); requests select it with `lora`")
    lo.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                    help="LoadLoraAdapter reads adapters only under DIR (repeatable; a path is resolved under each, "
                         "never out of it); without one, loading at run time is off")
    lo.add_argument("--max-loras", type=int, default=d.max_loras,
                    help="adapters resident at once; a request for another one swaps out the least recently used idle one")
    lo.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted (default 64)")
    sec = s.add_argument_group("security and tracing (docs/operations.md)")
    sec.add_argument("--tls-cert", default="", help="PEM certificate chain (reloaded on SIGHUP or when the file changes)")
    sec.add_argument("--tls-key", default="", help="PEM private key")
    sec.add_argument("--tls-client-ca", default="", help="PEM CA bundle: require client certificates (mutual TLS)")
    sec.add_argument("--api-key-file", default="",
                     help="API keys, one per line (# comments); also $TOKENLOOP_API_KEYS, comma-separated")
    sec.add_argument("--admin-key-file", default="",
                     help="admin keys, one per line: the management RPCs (LoadLoraAdapter, UnloadLoraAdapter, "
                          "FlushCache, profiling) need one (docs/robustness.md#who-may-manage-the-server)")
    sec.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout,
                     help="seconds a new connection has to finish its TLS handshake and HTTP/2 preface")
    sec.add_argument("--max-connections", type=int, default=d.max_connections,
                     help="open connections at once; more are closed when accepted (0: no cap)")
    sec.add_argument("--max-connections-per-peer", type=int, default=d.max_connections_per_peer,
                     help="open connections from one client address; its newest beyond are closed (0: no cap)")
    sec.add_argument("--otel-endpoint", default="",
                     help="OTLP gRPC endpoint for traces (default $OTEL_EXPORTER_OTLP_ENDPOINT; pip install tokenloop[otel])")
    e = s.add_argument_group("embedded engine (--backend engine)")
    e.add_argument("--kv-cache-tokens", type=int, default=None, help="KV-cache size in tokens")
    e.add_argument("--kv-cache-memory-fraction", type=float, default=None, help="KV-cache size as a fraction of free memory")
    e.add_argument("--max-num-tokens", type=int, default=None, help="token budget of one engine step")
    e.add_argument("--max-batch-size", type=int, default=None, help="sequences in one step")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="activations and KV cache (default float32; bfloat16 halves the KV cache's memory)")
    e.add_argument("--weights", choices=("fp32", "int8", "int4", "auto"), default=None,
                   help="int8: weights of every linear layer and the lm_head quantized at load time (symmetric, per "
                        "output channel), float32 activations; ~2x faster, perplexity +0.3%% against fp32's. int4: "
                        "the layers as 4 bits with a scale and a minimum per 32 columns (llama.cpp's Q4_1), the "
                        "lm_head int8 (docs/engine.md). auto: a GGUF file's own precision (docs/models.md). Default: fp32 "
                        "for a checkpoint directory (token-for-token equal to transformers), auto for a GGUF file")
    e.add_argument("--kv-dtype", choices=("auto", "fp32", "fp16"), default=None,
                   help="the KV cache's element type: fp16 halves its bytes (twice the tokens in a budget), fp32 is the "
                        "activations' own; auto: fp16 with --weights int8/int4, fp32 otherwise (docs/engine.md)")
    e.add_argument("--num-threads", type=int, default=None, help="torch threads")
    e.add_argument("--route-retiming", action=argparse.BooleanOptionalAction, default=None,
                   help="with --weights int8/int4: now and then run a step on another route of the calibrated family "
                        "(same bits) and switch to one that measures faster (docs/engine.md; default on)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of a prompt prefix seen before (default on)")
    e.add_argument("--attention-backend", choices=("auto", "native", "torch"), default=None,
                   help="decode attention: native C kernel over the paged KV cache (float32), or torch; "
                        "auto: native where it compiles")
    e.add_argument("--matmul-backend", choices=("auto", "torch", "numpy", "numpy2", "native2", "f32c2"), default=None,
                   help="who multiplies the weights; auto: timed at start-up per batch size")
    e.add_argument("--embed-pooling", choices=("last", "mean"), default=None,
                   help="Embed requests that name no pooling: the last prompt token's final hidden state or the mean "
                        "over the prompt (default: the model's sentence-transformers config, else last; docs/engine.md)")
    e.add_argument("--embed-normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="Embed requests that do not say: scale the vector to unit L2 norm (default: the model's "
                        "sentence-transformers config, else on)")
    sp = s.add_argument_group("speculative decoding (docs/engine.md#speculative-decoding, docs/trtllm.md)")
    sp.add_argument("--speculative", choices=("off", "ngram", "lookahead", "draft_target"), default=None,
                    help="draft tokens and verify them in one step, with output unchanged. ngram: prompt lookup "
                         "(both backends); lookahead, draft_target: TensorRT-LLM's own (default: ngram on the engine, off "
                         "on TensorRT-LLM)")
    sp.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="the most tokens one sequence drafts per step (default 4; the engine adapts it per sequence)")
    sp.add_argument("--speculative-max-batch-size", type=int, default=None,
                    help="no drafting in a step with more sequences than this (default 4 on the engine; "
                         "TensorRT-LLM's max_concurrency)")
    sp.add_argument("--speculative-model", default=None, metavar="DIR",
                    help="the draft model of --speculative draft_target (TensorRT-LLM's LLM API)")
    sp.add_argument("--lookahead-config", type=_lookahead, default=None, metavar="W,N,G",
                    help="--speculative lookahead's window, n-gram and verification-set sizes (TensorRT-LLM)")
    t = s.add_argument_group("TensorRT-LLM (--backend trtllm)")
    t.add_argument("--trtllm-api", choices=("auto", "llm", "executor"), default=None,
                   help="TensorRT-LLM's LLM API or its C++ executor (auto: whichever is installed, LLM API first)")
    t.add_argument("--kv-cache-free-gpu-memory-fraction", type=float, default=None,
                   help="KV-cache size as a fraction of free GPU memory")
    t.add_argument("--enable-block-reuse", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorRT-LLM's prefix cache (KV block reuse)")
    t.add_argument("--kv-event-buffer-max-size", type=int, default=None,
                   help="KV-cache events TensorRT-LLM buffers for SubscribeKvEvents (default 1024; 0: none)")
    t.add_argument("--enable-chunked-context", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill long prompts in chunks between decode steps")
    t.add_argument("--scheduler-policy", choices=("max_utilization", "guaranteed_no_evict"), default=None,
                   help="TensorRT-LLM's batch scheduler")
    t.add_argument("--tensor-parallel-size", type=int, default=None, help="GPUs one layer is split across")
    t.add_argument("--pipeline-parallel-size", type=int, default=None, help="GPUs the layers are split across")
    t.add_argument("--beam-width", type=int, default=None, help="largest beam a request may ask for")
    t.add_argument("--guided-decoding-backend", choices=("auto", "xgrammar", "llguidance", "none"), default=None,
                   help="who matches structured output on the GPU; auto: llguidance on the LLM API, xgrammar on the "
                        "C++ executor")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's config from `tokenloop serve`'s flags: a server flag sets the ServerConfig field of its name, the
    executor's flags (ENGINE_FLAGS or TRTLLM_FLAGS) that were given go into executor_options."""
    names = TRTLLM_FLAGS if args.backend == "trtllm" else ENGINE_FLAGS
    options = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if args.backend != "trtllm" and options.get("weights", "auto") == "auto":
        options.pop("weights", None)
        mode = weights_for(args.model or str(DEFAULT_MODEL_DIR))
        if mode is not None:
            options["weights"] = mode
    if args.backend == "trtllm" and args.lora:  # TensorRT-LLM sets LoRA up at construction (trtllm/lora.py)
        options.update(lora_dirs=tuple(v.partition("=")[2] for v in args.lora), max_loras=args.max_loras)
    flags = vars(args)
    server = {f.name: flags[f.name] for f in dataclasses.fields(ServerConfig) if f.name in flags}
    server.update(model=args.model or str(DEFAULT_MODEL_DIR), loras=tuple(args.lora), lora_roots=tuple(args.lora_root),
                  executor_options=options)
    if args.default_max_new_tokens is None:  # the default, or --max-new-tokens when that is smaller
        server["default_max_new_tokens"] = min(ServerConfig().default_max_new_tokens, args.max_new_tokens)
    return ServerConfig(**server)


def weights_for(model: str) -> str | None:
    """`--weights auto` (the default for a GGUF file): the mode closest to the file's own precision; None (fp32) for
    a checkpoint directory, or a file that check_startup will refuse with its reason."""
    if not is_gguf(model):
        return None
    try:
        return open_gguf(model).weights_mode()
    except GGUFError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"tokenloop: {exc}", file=sys.stderr)
        return 2
    try:
        check_startup(config)  # the model, TLS files, API keys and ports, before anything loads
    except StartupError as exc:
        print(f"tokenloop: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(_serve(config))


async def _serve(config: ServerConfig) -> int:
    from .server import run
    return await run(config)


if __name__ == "__main__":
    sys.exit(main())
