"""API keys without a server: the bearer header read, keys matched in constant time, and a key file with no key (or
none at all) stopping start-up before a port opens. Through a server: tests/integration/test_security.py."""

from __future__ import annotations

import pytest

from tokenloop.service.config import ServerConfig
from tokenloop.service.security import _bearer, key_matches


def test_bearer_parsing_and_constant_time_match():
    keys = [b"alpha", b"beta"]
    assert _bearer((("authorization", "Bearer beta"),)) == b"beta"
    assert _bearer((("authorization", "bearer   beta "),)) == b"beta"
    assert _bearer((("authorization", "Basic beta"),)) == b"" and _bearer(()) == b""
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
