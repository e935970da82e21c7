"""Server configuration: one dataclass filled from the command line, checked on creation."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .placement import check_spec

LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # an adapter's name (--lora, LoadLoraAdapter)


def parse_lora_flag(value: str) -> tuple[str, str]:
    """`NAME=DIR` of `--lora` -> (name, dir); ValueError naming the rule."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ValueError(f"--lora {value!r}: expected NAME=DIR")
    if not LORA_NAME.fullmatch(name):
        raise ValueError(f"--lora {value!r}: the name must be 1-128 letters, digits, '.', '_' or '-'")
    return name, path


def parse_lookahead_flag(value: str) -> tuple[int, int, int]:
    """`--lookahead-config W,N,G` -> (window, n-gram, verification set), each >= 1; ValueError naming the flag."""
    try:
        sizes = tuple(int(p) for p in value.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"--lookahead-config {value!r}: expected W,N,G, three integers >= 1 (window size, n-gram "
                         "size, verification set size)")
    return sizes


ROUTER_PROTOCOLS = ("both", "vllm", "trtllm")  # --router-protocol
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"


# Flags with a lower bound: (field, the least value, whether it must be greater, what the message adds)
_AT_LEAST = (
    ("max_queue", 0, False, ""),
    ("stall_timeout", 0, False, " (0: never)"),
    ("slow_reader_grace", 0, False, " (0: off)"),
    ("max_queue_wait", 0, False, " (0: no bound)"),
    ("shutdown_grace", 0, False, ""),
    ("kv_events_heartbeat", 0, True, ""),
    ("stream_interval", 1, False, ""),
    ("tokenize_inline_chars", 0, False, ""),
    ("max_stop_token_ids", 0, False, ""),
    ("max_detokenize_ids", 0, False, " (0: the model's context length)"),
    ("max_grammar_bytes", 1, False, ""),
    ("grammar_compile_timeout", 0, True, ""),
    ("grammar_cache_size", 0, False, ""),
    ("grammar_compile_workers", 1, False, ""),
    ("max_grammar_compiles_waiting", 0, False, ""),
    ("handshake_timeout", 0, True, ""),
    ("max_connections", 0, False, " (0: no cap)"),
    ("max_connections_per_peer", 0, False, " (0: no cap)"),
)


@dataclass(slots=True)
class ServerConfig:
    """Everything `tokenloop serve` takes."""

    model: str = str(DEFAULT_MODEL_DIR)
    backend: str = "engine"  # engine | trtllm
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0: no metrics endpoint
    max_concurrent_requests: int = 64
    max_queue: int = 256
    shutdown_grace: float = 30.0
    max_new_tokens: int = 4096
    default_max_new_tokens: int = 256
    max_prompt_tokens: int = 0  # 0: the model's context minus one
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 256  # a model's special tokens fit (a few hundred at most); each is a set lookup per token
    max_detokenize_ids: int = 0  # Detokenize: 0 = the model's context length (the most one sequence can hold)
    allow_special_tokens_in_chat: bool = False  # special-token text in chat content: encoded as text unless set
    max_grammar_bytes: int = 262144  # largest JSON schema / regex / grammar / structural tag accepted
    grammar_compile_timeout: float = 10.0  # seconds one constraint may take to compile
    grammar_cache_size: int = 256  # compiled constraints kept (LRU), by their text
    grammar_compile_workers: int = 2  # compile processes (killed at the timeout) and the threads that build matchers
    max_grammar_compiles_waiting: int = 8  # compiles waiting for a process before RESOURCE_EXHAUSTED
    max_message_bytes: int = 16 * 1024 * 1024
    handshake_timeout: float = 5.0  # seconds a new connection has for its TLS handshake, HTTP/2 preface and SETTINGS
    max_connections: int = 1024  # open connections at once; more are closed at accept (0: no cap)
    max_connections_per_peer: int = 256  # open connections from one peer address (0: no cap; Linux)
    poll_timeout: float = 0.02
    kv_events_heartbeat: float = 1.0  # SubscribeKvEvents: seconds between load-only batches while idle
    router_protocol: str = "both"  # smg's worker protocols served: both | vllm | trtllm (docs/router.md)
    stall_timeout: float = 60.0  # a stream whose reader stops reading this long is aborted (0: never)
    slow_reader_grace: float = 1.0  # a stream whose writes stall this long gives back its slot, generation paused (0: off)
    max_queue_wait: float = 30.0  # seconds a request may wait for a slot before RESOURCE_EXHAUSTED (0: no bound)
    stream_interval: int = 1  # send a sequence's tokens at most every N tokens while the reader keeps up
    coalesce: bool = True  # a reader that fell behind gets all ready tokens of a sequence in one message
    tokenize_inline_chars: int = 2048  # longer texts and chats are tokenized on a worker thread (the GIL released)
    front_cpu: str = "auto"  # the event-loop and looper threads share one CPU: auto | off | a CPU number
    exit_on_engine_death: bool = True
    model_id: str = ""  # default: the model directory's name
    log_level: str = "INFO"
    log_format: str = "text"  # text | json
    tls_cert: str = ""  # PEM certificate chain; with tls_key: serve TLS (reloaded on SIGHUP or file change)
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mutual TLS)
    api_key_file: str = ""  # one key per line, `#` comments; also $TOKENLOOP_API_KEYS (comma-separated)
    admin_key_file: str = ""  # keys of the management RPCs (LoRA load / unload, FlushCache), one per line
    otel_endpoint: str = ""  # OTLP endpoint for traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT; needs the otel extra)
    executor_options: dict = field(default_factory=dict)  # passed to the backend's factory
    loras: tuple[str, ...] = ()  # --lora NAME=DIR, loaded at start-up (service/lora.py)
    lora_roots: tuple[str, ...] = ()  # --lora-root DIR: LoadLoraAdapter reads only under these (none: it is off)
    max_loras: int = 8  # --max-loras: adapters resident in the executor at once

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError("--max-loras must be >= 1")
        if len(self.loras) > self.max_loras:
            raise ValueError(f"{len(self.loras)} --lora adapters exceed --max-loras {self.max_loras}")
        names = [parse_lora_flag(value)[0] for value in self.loras]
        if len(set(names)) < len(names):
            raise ValueError("--lora names must be unique")
        if self.backend not in ("engine", "trtllm"):
            raise ValueError(f"--backend must be 'engine' or 'trtllm'; got {self.backend!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be between 0 and 65535")
        if self.max_concurrent_requests < 1:
            raise ValueError("--max-concurrent-requests must be >= 1")
        _check_limits(self)
        if self.router_protocol not in ROUTER_PROTOCOLS:
            raise ValueError(f"--router-protocol must be one of {', '.join(ROUTER_PROTOCOLS)}; "
                             f"got {self.router_protocol!r}")
        check_spec(self.front_cpu)
        for name, least, strict, note in _AT_LEAST:
            value = getattr(self, name)
            if not (value > least if strict else value >= least):
                raise ValueError(f"--{name.replace('_', '-')} must be {'>' if strict else '>='} {least}{note}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"--log-format must be 'text' or 'json'; got {self.log_format!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")


GRPC_INT_MAX = 2**31 - 1  # grpc core's integer channel arguments
ENGINE_POSITIVE = ("max_batch_size", "max_num_tokens", "num_threads", "block_size", "kv_cache_tokens", "max_lora_rank",
                   "num_speculative_tokens", "speculative_max_batch_size")


def _check_limits(c: ServerConfig) -> None:
    """The request limits and the engine's sizes, each message naming its flag and what was given."""
    if not 0 <= c.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be between 0 and 65535; got {c.metrics_port}")
    if c.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {c.max_new_tokens}")
    if not 1 <= c.default_max_new_tokens <= c.max_new_tokens:
        raise ValueError(f"--default-max-new-tokens must be between 1 and --max-new-tokens ({c.max_new_tokens}); "
                         f"got {c.default_max_new_tokens}")
    for flag, value, least in (("--max-n", c.max_n, 1), ("--max-prompt-tokens", c.max_prompt_tokens, 0),
                               ("--max-stop-strings", c.max_stop_strings, 0),
                               ("--max-stop-string-length", c.max_stop_string_length, 1),
                               ("--max-message-bytes", c.max_message_bytes, 1), ("--stall-timeout", c.stall_timeout, 0)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}; got {value}")
    for name in ENGINE_POSITIVE:
        value = c.executor_options.get(name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    speculative = c.executor_options.get("speculative")
    if c.backend == "engine" and speculative in ("lookahead", "draft_target"):
        raise ValueError(f"--speculative {speculative} is TensorRT-LLM's (--backend trtllm); the embedded engine "
                         "takes off or ngram")
    # values that become grpc core channel arguments (C ints): a larger one failed start-up with an OverflowError
    for flag, value, most in (("--handshake-timeout", c.handshake_timeout, GRPC_INT_MAX // 1000),
                              ("--max-connections", c.max_connections, GRPC_INT_MAX),
                              ("--max-message-bytes", c.max_message_bytes, GRPC_INT_MAX)):
        if value > most:
            raise ValueError(f"{flag} must be <= {most}; got {value}")
    fraction = c.executor_options.get("kv_cache_memory_fraction")
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--kv-cache-memory-fraction must be > 0 and <= 1; got {fraction}")
