"""API keys without a server: the bearer header read, keys matched in constant time, and a key file with no key (or
none at all) stopping start-up before a port opens. Through a server: tests/integration/test_security.py."""

from __future__ import annotations

import pytest

from tokenloop.service.config import ServerConfig
from tokenloop.service.security import bearer_token, key_matches


def test_bearer_parsing_and_constant_time_match():
    keys = [b"alpha", b"beta"]
    assert bearer_token((("authorization", "Bearer beta"),)) == b"beta"
    assert bearer_token((("authorization", "bearer   beta "),)) == b"beta"
    assert bearer_token((("authorization", "Basic beta"),)) == b"" and bearer_token(()) == b""
    assert key_matches(b"beta", keys) and not key_matches(b"bet", keys) and not key_matches(b"", keys + [b""])


def test_an_empty_or_missing_api_key_file_stops_start_up(tmp_path, monkeypatch):
    from tests.conftest import run
    from tokenloop.service.server import interceptors
    from tokenloop.service.server import run as serve
    monkeypatch.delenv("TOKENLOOP_API_KEYS", raising=False)
    (tmp_path / "keys").write_text("# nothing here yet\n\n")
    with pytest.raises(ValueError, match="holds no API key"):
        interceptors(ServerConfig(api_key_file=str(tmp_path / "keys")))
    for path in (tmp_path / "keys", tmp_path / "missing"):
        assert run(serve(ServerConfig(api_key_file=str(path), port=0))) == 2  # not an open server


@pytest.mark.parametrize("keys, admin, method, token, expected", [
    # a server with API keys and admin keys
    ([b"user"], [b"root"], "/tokenloop.v1.TextGeneration/Generate", b"user", None),
    ([b"user"], [b"root"], "/tokenloop.v1.TextGeneration/Generate", b"root", None),  # an admin key is an API key
    ([b"user"], [b"root"], "/tokenloop.v1.TextGeneration/Generate", b"", "UNAUTHENTICATED"),
    ([b"user"], [b"root"], "/tokenloop.v1.TextGeneration/LoadLoraAdapter", b"root", None),
    ([b"user"], [b"root"], "/tokenloop.v1.TextGeneration/LoadLoraAdapter", b"user", "PERMISSION_DENIED"),
    ([b"user"], [b"root"], "/vllm.grpc.engine.VllmEngine/FlushCache", b"", "UNAUTHENTICATED"),
    ([b"user"], [b"root"], "/vllm.grpc.engine.VllmEngine/FlushCache", b"rooot", "UNAUTHENTICATED"),
    # API keys only: management is off
    ([b"user"], [], "/tokenloop.v1.TextGeneration/UnloadLoraAdapter", b"user", "PERMISSION_DENIED"),
    # admin keys only: generation is open, management is not
    ([], [b"root"], "/tokenloop.v1.TextGeneration/Generate", b"", None),
    ([], [b"root"], "/vllm.grpc.engine.VllmEngine/FlushCache", b"", "PERMISSION_DENIED"),
    ([], [b"root"], "/vllm.grpc.engine.VllmEngine/FlushCache", b"user", "UNAUTHENTICATED"),
    ([], [b"root"], "/vllm.grpc.engine.VllmEngine/StartProfile", b"root", None),
])
def test_who_may_call_what(keys, admin, method, token, expected):
    from tokenloop.service.security import ApiKeyInterceptor

    got = ApiKeyInterceptor(keys, admin).decide(method, token)
    assert (got[0].name if got else None) == expected
    if expected == "PERMISSION_DENIED":
        assert "management RPC: it needs an admin key (--admin-key-file)" in got[1]
        assert ("management RPCs are off" in got[1]) == (not admin)
