"""Structured output at the door: the rules on a request's constraint (either API), and its compile off the event loop.

`structured_of` and `structured_of_guided` check what needs no compile (one rule, one message each) and return an
uncompiled `StructuredOutput`; `GrammarGate.admit` then compiles it. A cache hit: here, in microseconds. A miss: first
in a compile process (service/compile_pool.py) under `--grammar-compile-timeout`, the process killed at the timeout;
then, once it compiled there, the matcher is built from its grammar text on a compile thread (llguidance releasing the
GIL), in about the time the check took. Neither is shared with tokenization. A schema, regex or grammar the library
refuses is INVALID_ARGUMENT naming the field and carrying the library's words; a full compile queue
(`--grammar-compile-workers` running, `--max-grammar-compiles-waiting` waiting) is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import Executor

from smg_grpc_proto.generated import trtllm_service_pb2 as tpb

from tokenloop.core.request import StructuredOutput, ValidRequest
from tokenloop.core.structured import GrammarCompiler, GrammarError, describe_error, one_line

from .compile_pool import (
    CompileCrashed,
    CompilePool,
    CompilePoolClosed,
    CompileQueueFull,
    CompileRefused,
    CompileTimeout,
)
from .errors import Overloaded, Unavailable, ValidationError

log = logging.getLogger("tokenloop.service")
GUIDE_TYPES = tpb.GuidedDecodingParams.GuideType
# trtllm GuideType -> our kind. GUIDE_TYPE_JSON is what TensorRT-LLM's OpenAI server sends for
# `response_format: json_object`, and its llguidance backend compiles it to any JSON object: so do we.
GUIDE_KINDS = {GUIDE_TYPES.GUIDE_TYPE_JSON: "json_object", GUIDE_TYPES.GUIDE_TYPE_JSON_SCHEMA: "json_schema",
               GUIDE_TYPES.GUIDE_TYPE_REGEX: "regex", GUIDE_TYPES.GUIDE_TYPE_EBNF_GRAMMAR: "grammar",
               GUIDE_TYPES.GUIDE_TYPE_STRUCTURAL_TAG: "structural_tag"}


def check_size(spec: str, field: str, max_bytes: int) -> None:
    size = len(spec) if len(spec) > max_bytes else len(spec.encode())  # a character is at least one byte
    if size > max_bytes:
        raise ValidationError("structure_too_large", f"`{field}` is {size} bytes; the limit is {max_bytes} "
                                                     "(--max-grammar-bytes)")


def structured_of(request, max_bytes: int) -> StructuredOutput | None:
    """tokenloop.v1 `GenerateRequest.structured` (None: free text), checked but not compiled."""
    kind = request.WhichOneof("structured")
    if kind is None:
        return None
    if kind == "json_object":
        if not request.json_object:
            raise ValidationError("json_object_false", "`json_object` must be true when set (leave it unset for "
                                                       "free text)")
        return StructuredOutput("json_object")
    spec = getattr(request, kind)
    if not spec:
        raise ValidationError("empty_structure", f"`{kind}` must not be empty")
    check_size(spec, kind, max_bytes)
    return StructuredOutput(kind, spec)


def structured_of_guided(request, max_bytes: int) -> StructuredOutput | None:
    """trtllm `GenerateRequest.guided_decoding` (None when unset), checked but not compiled."""
    if not request.HasField("guided_decoding"):
        return None
    guided = request.guided_decoding
    kind = GUIDE_KINDS.get(guided.guide_type)
    if kind is None:
        names = ", ".join(GUIDE_TYPES.Name(t) for t in GUIDE_KINDS)
        raise ValidationError("guide_type", f"`guided_decoding.guide_type` must be one of {names}; "
                                            f"got {guided.guide_type}")
    if kind == "json_object":
        return StructuredOutput("json_object")  # the guide, if any, is not read (TensorRT-LLM does not either)
    if not guided.guide:
        raise ValidationError("empty_structure", f"`guided_decoding.guide` must not be empty for "
                                                 f"{GUIDE_TYPES.Name(guided.guide_type)}")
    check_size(guided.guide, "guided_decoding.guide", max_bytes)
    return StructuredOutput(kind, guided.guide)


class GrammarGate:
    """Compiles the constraint of admitted requests: cached ones at once, the others in a compile process (killed
    at the timeout), then on a compile thread."""

    def __init__(self, compiler: GrammarCompiler, processes: CompilePool | None, timeout: float,
                 threads: Executor | None = None):
        self.compiler = compiler
        self.processes = processes  # None: no process check (a bench of the cached path)
        self.threads = threads  # None: the event loop's default executor
        self.timeout = timeout

    async def admit(self, valid: ValidRequest, field: str | None = None) -> ValidRequest:
        """`valid` with its constraint compiled; ValidationError naming `field` (default: the kind) when it does
        not compile, or not within the timeout; Overloaded when too many compiles wait."""
        structured = valid.structured
        if structured is None or structured.grammar is not None:
            return valid
        field = field or structured.kind
        grammar = self.compiler.cached(structured.kind, structured.spec)
        if grammar is None:
            grammar = await self._compile(structured, field)
        return dataclasses.replace(valid, structured=dataclasses.replace(structured, grammar=grammar))

    async def _compile(self, structured: StructuredOutput, field: str):
        kind, spec = structured.kind, structured.spec
        try:
            text = None
            if self.processes is not None:
                text = await self.processes.check(kind, spec, self.timeout)
            return await asyncio.get_running_loop().run_in_executor(self.threads, self.compiler.compile, kind, spec,
                                                                    text)
        except CompileTimeout as exc:
            if exc.waited:
                raise Overloaded(f"no compile process was free within {self.timeout:g} s (--grammar-compile-workers "
                                 f"{self.processes.num_workers}, all busy): retry later") from None
            log.warning("a %s did not compile within %.3g s (%d bytes): its compile process was killed", kind,
                        self.timeout, len(spec))
            raise ValidationError("structure_compile_timeout",
                                  f"`{field}` did not compile within {self.timeout:g} s (--grammar-compile-timeout): "
                                  "make it simpler") from None
        except CompileQueueFull as exc:
            raise Overloaded(f"too many constraints are compiling ({exc}; --max-grammar-compiles-waiting): retry "
                             f"later, or send one the server has compiled before") from None
        except CompilePoolClosed:
            raise Unavailable("the server is shutting down") from None
        except (GrammarError, CompileRefused) as exc:
            message = describe_error(GrammarError(exc.kind, str(exc)))
            raise ValidationError("invalid_structure", message.replace(f"`{exc.kind}`", f"`{field}`", 1)) from None
        except CompileCrashed as exc:
            log.warning("a %s crashed its compile process (%d bytes): %s", kind, len(spec), exc)
            raise ValidationError("invalid_structure", f"`{field}` does not compile: it crashed the compiler "
                                                       f"({exc})") from None
        except Exception as exc:  # noqa: BLE001 - whatever the library raises on a bad input is the input's fault
            raise ValidationError("invalid_structure", f"`{field}` does not compile: "
                                                       f"{one_line(f'{type(exc).__name__}: {exc}')}") from None
