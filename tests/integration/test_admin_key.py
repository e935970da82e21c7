"""The management RPCs of every API behind their own key (`--admin-key-file`), through a real server: without a key
UNAUTHENTICATED, with an API key PERMISSION_DENIED, with an admin key the RPC runs; an admin key is an API key too;
health and reflection stay open. The decision table without a server: tests/unit/test_api_keys.py."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.service.security import MANAGEMENT_METHODS
from tokenloop.v1 import tokenloop_pb2 as pb

C = grpc.StatusCode
AUTH = {None: (), "user": (("authorization", "Bearer user-key"),), "admin": (("authorization", "Bearer admin-key"),)}


@pytest.fixture
def key_files(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENLOOP_API_KEYS", raising=False)
    (tmp_path / "api-keys").write_text("user-key\n")
    (tmp_path / "admin-keys").write_text("# operators\nadmin-key\n")
    return str(tmp_path / "api-keys"), str(tmp_path / "admin-keys")


async def status(channel, method: str, who: str | None) -> tuple[C, str]:
    """A management RPC with an empty request as `who` (no key, an API key, an admin key)."""
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        await call(b"", metadata=AUTH[who], timeout=10)
        return C.OK, ""
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details()


def test_management_rpcs_of_every_api_need_the_admin_key(tokenizer_dir, key_files):
    api_keys, admin_keys = key_files

    async def body():
        async with serving(tokenizer_dir, api_key_file=api_keys, admin_key_file=admin_keys) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                out = {}
                for method in sorted(MANAGEMENT_METHODS):
                    out[method] = [await status(channel, method, who) for who in (None, "user", "admin")]
                gen = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=2))
                by_admin = [m async for m in stub.Generate(gen, metadata=AUTH["admin"])]
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                return out, by_admin, health

    out, by_admin, health = run(body())
    assert len(out) == 5  # LoadLoraAdapter, UnloadLoraAdapter, FlushCache, StartProfile, StopProfile
    for method, (none, user, admin) in out.items():
        name = method.rsplit("/", 1)[-1]
        assert none == (C.UNAUTHENTICATED, "missing or invalid API key"), method
        assert user == (C.PERMISSION_DENIED, f"{name} is a management RPC: it needs an admin key (--admin-key-file)")
        assert admin[0] not in (C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.UNKNOWN, C.INTERNAL), (method, admin)
    # with the admin key each RPC ran and gave its own answer: the scripted executor has no LoRA, no prefix cache
    assert {admin[0] for _, _, admin in out.values()} == {C.UNIMPLEMENTED}
    assert by_admin[-1].HasField("complete")  # an admin key is an API key too
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_without_an_admin_key_file_management_is_off_and_with_only_one_generation_is_open(tokenizer_dir, key_files):
    api_keys, admin_keys = key_files
    unload = "/tokenloop.v1.TextGeneration/UnloadLoraAdapter"

    async def body():
        async with serving(tokenizer_dir, api_key_file=api_keys) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                off = await status(channel, unload, "user")
        async with serving(tokenizer_dir, admin_key_file=admin_keys) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                anonymous = await status(channel, unload, None), await status(channel, unload, "admin")
                info = await stub.GetModelInfo(pb.GetModelInfoRequest())  # no API key needed
        return off, anonymous, info

    off, (anonymous, admin), info = run(body())
    assert off == (C.PERMISSION_DENIED, "UnloadLoraAdapter is a management RPC: it needs an admin key "
                   "(--admin-key-file); this server has none, so management RPCs are off")
    assert anonymous[0] == C.PERMISSION_DENIED
    assert admin[0] == C.UNIMPLEMENTED  # it ran: the scripted executor has no LoRA
    assert info.model_id


def test_every_management_method_is_served(tokenizer_dir):
    """MANAGEMENT_METHODS names methods that exist (a renamed RPC would otherwise be left open)."""
    async def body():
        async with serving(tokenizer_dir) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return [await status(channel, m, None) for m in sorted(MANAGEMENT_METHODS)]

    assert all(code != C.UNIMPLEMENTED or "Method not found" not in details for code, details in run(body()))
