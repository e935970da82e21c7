"""Undecodable payloads (garbage, invalid UTF-8) through an in-process server, on every RPC of every service that
reflection lists: INVALID_ARGUMENT naming the request type, rate-limited log lines, no traceback, and the server
serves on; without an API key the refusal is UNAUTHENTICATED (the decoder alone: tests/unit/test_decoding.py)."""

from __future__ import annotations

import logging
import time

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.v1 import tokenloop_pb2 as pb

GARBAGE = b"\xff" * 8  # a tag whose varint never ends


def bad_utf8(message) -> bytes | None:
    """A payload with invalid UTF-8 in the first top-level string field of `message`, if it has one."""
    field = next((f for f in message.fields if f.type == f.TYPE_STRING and not f.is_repeated), None)
    if field is None:
        return None
    return bytes([(field.number << 3) | 2, 2]) + b"\xff\xfe" if field.number < 16 else None


async def services(channel) -> list:
    """Every service the server lists through reflection, as descriptors."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name async for r in call for s in r.list_services_response.service]
    return [descriptor_pool.Default().FindServiceByName(name) for name in names]


async def call_raw(channel, service, method, payload: bytes, metadata=None):
    """Send `payload` as the request of `method` whatever its shape; returns the error (None: it succeeded)."""
    path = f"/{service.full_name}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            [m async for m in channel.stream_stream(path)(iter([payload]), metadata=metadata, timeout=10)]
        elif method.client_streaming:
            await channel.stream_unary(path)(iter([payload]), metadata=metadata, timeout=10)
        elif method.server_streaming:
            [m async for m in channel.unary_stream(path)(payload, metadata=metadata, timeout=10)]
        else:
            await channel.unary_unary(path)(payload, metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as err:
        return err
    return None


def test_undecodable_requests_get_invalid_argument_on_every_rpc_of_every_service(tokenizer_dir, caplog):
    seen: list[tuple[str, str, grpc.StatusCode, str]] = []

    async def body():
        async with serving(tokenizer_dir) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                found = await services(ch)
                assert {s.full_name for s in found} >= {"tokenloop.v1.TextGeneration", "trtllm.TrtllmService",
                                                        "grpc.health.v1.Health",
                                                        "grpc.reflection.v1alpha.ServerReflection"}
                for service in found:
                    for method in service.methods:
                        for payload in (GARBAGE, bad_utf8(method.input_type)):
                            if payload is not None:
                                err = await call_raw(ch, service, method, payload)
                                seen.append((f"{method.full_name} {payload!r}", method.input_type.full_name,
                                             err and err.code(), err and err.details()))
            msgs = [m async for m in stub.Generate(pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(
                max_new_tokens=2)))]
            assert msgs[-1].complete.finish_reason == pb.LENGTH  # and the server serves on

    start = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        run(body())
    elapsed = time.monotonic() - start
    assert len(seen) > 30
    for what, type_name, code, details in seen:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, what
        detail = "String field had bad UTF-8" if "xff\\xfe" in what else "Wire format was corrupt"
        assert details == f"the request is not a valid {type_name}: {detail}", what
    refusals = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert 1 <= len(refusals) <= 1 + elapsed // 10  # one line per 10 s at most
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no traceback


def test_unauthenticated_garbage_is_refused_without_a_traceback(tokenizer_dir, tmp_path, caplog):
    (tmp_path / "keys").write_text("alpha-key\n")
    text_generation = pb.DESCRIPTOR.services_by_name["TextGeneration"]
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]

    async def body():
        async with serving(tokenizer_dir, api_key_file=str(tmp_path / "keys")) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                for _ in range(20):
                    for name in ("Generate", "Detokenize", "GetModelInfo"):
                        err = await call_raw(ch, text_generation, text_generation.methods_by_name[name], GARBAGE)
                        assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED,
                                                               "missing or invalid API key")
                    err = await call_raw(ch, health, health.methods_by_name["Check"], GARBAGE)  # exempt from keys
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                key = (("authorization", "Bearer alpha-key"),)
                err = await call_raw(ch, text_generation, text_generation.methods_by_name["Generate"], GARBAGE, key)
                assert err.details() == "the request is not a valid tokenloop.v1.GenerateRequest: Wire format was corrupt"

    with caplog.at_level(logging.DEBUG):
        run(body())
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 2 <= len(warnings) <= 4  # 81 refusals: a line for the first key refusal and the first garbage, + 1 per 10 s
    assert not [r for r in caplog.records if r.exc_info]
