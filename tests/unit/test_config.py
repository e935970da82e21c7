"""ServerConfig and the serve flags that fill it: flags reach the config, and a half-configured or out-of-range
setting is refused with a message naming the flag (more flags: tests/unit/test_serve_help.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenloop.service.cli import build_parser, config_from_args
from tokenloop.service.config import DEFAULT_MODEL_DIR, ServerConfig


def test_security_and_limit_flags_reach_the_config():
    args = build_parser().parse_args([
        "serve", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem", "--api-key-file", "keys",
        "--log-format", "json", "--log-level", "DEBUG", "--max-stop-strings", "3", "--max-stop-string-length", "9",
        "--max-prompt-tokens", "100", "--max-n", "2", "--max-new-tokens", "50", "--max-message-bytes", "4096",
        "--otel-endpoint", "http://collector:4317"])
    c = config_from_args(args)
    assert (c.tls_cert, c.tls_key, c.tls_client_ca, c.api_key_file) == ("c.pem", "k.pem", "ca.pem", "keys")
    assert (c.log_format, c.log_level, c.otel_endpoint) == ("json", "DEBUG", "http://collector:4317")
    assert (c.max_stop_strings, c.max_stop_string_length, c.max_prompt_tokens, c.max_n, c.max_new_tokens,
            c.max_message_bytes) == (3, 9, 100, 2, 50, 4096)


@pytest.mark.parametrize("kw, message", [
    ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "ca.pem"}, "--tls-client-ca needs --tls-cert and --tls-key"),
    ({"log_format": "xml"}, "--log-format must be 'text' or 'json'; got 'xml'")])
def test_config_refuses_half_configured_security(kw, message):
    with pytest.raises(ValueError) as err:
        ServerConfig(**kw)
    assert str(err.value) == message


@pytest.mark.parametrize("field, message", [
    ("max_stop_token_ids", "--max-stop-token-ids must be >= 0"),
    ("max_detokenize_ids", "--max-detokenize-ids must be >= 0 (0: the model's context length)")])
def test_config_checks_the_new_limits(field, message):
    with pytest.raises(ValueError) as exc:
        ServerConfig(**{field: -1})
    assert str(exc.value) == message


def test_management_and_connection_flags_reach_the_config():
    args = build_parser().parse_args([
        "serve", "--admin-key-file", "admin", "--lora-root", "/a", "--lora-root", "/b", "--handshake-timeout", "2.5",
        "--max-connections", "100", "--max-connections-per-peer", "7"])
    c = config_from_args(args)
    assert (c.admin_key_file, c.lora_roots) == ("admin", ("/a", "/b"))
    assert (c.handshake_timeout, c.max_connections, c.max_connections_per_peer) == (2.5, 100, 7)
    d = config_from_args(build_parser().parse_args(["serve"]))
    assert (d.lora_roots, d.handshake_timeout, d.max_connections, d.max_connections_per_peer) == ((), 5.0, 1024, 256)


@pytest.mark.parametrize("kw, message", [
    ({"handshake_timeout": 0}, "--handshake-timeout must be > 0"),
    ({"max_connections": -1}, "--max-connections must be >= 0 (0: no cap)"),
    ({"max_connections_per_peer": -1}, "--max-connections-per-peer must be >= 0 (0: no cap)"),
    # grpc core takes them as C ints: past 2**31 - 1 the server's creation raised OverflowError with a traceback
    ({"handshake_timeout": 1e7}, "--handshake-timeout must be <= 2147483; got 10000000.0"),
    ({"handshake_timeout": float("inf")}, "--handshake-timeout must be <= 2147483; got inf"),
    ({"max_connections": 2**31}, "--max-connections must be <= 2147483647; got 2147483648"),
    ({"max_message_bytes": 2**32}, "--max-message-bytes must be <= 2147483647; got 4294967296")])
def test_config_checks_the_connection_bounds(kw, message):
    with pytest.raises(ValueError) as exc:
        ServerConfig(**kw)
    assert str(exc.value) == message


def test_each_server_flag_sets_the_field_of_its_name():
    """config_from_args passes a server flag to the ServerConfig field of its name: with no flags the config is the
    default one, and every number field that has a flag, given another value on the command line, has it."""
    assert config_from_args(build_parser().parse_args(["serve"])) == ServerConfig(model=str(DEFAULT_MODEL_DIR))
    d = ServerConfig()
    others = {f.name: getattr(d, f.name) + 1 for f in dataclasses.fields(ServerConfig)
              if type(getattr(d, f.name)) in (int, float)}
    words = [word for name, value in others.items() for word in ("--" + name.replace("_", "-"), str(value))]
    args, unknown = build_parser().parse_known_args(["serve", *words])
    flagged = {name: value for name, value in others.items() if "--" + name.replace("_", "-") not in unknown}
    assert len(flagged) > 20 and len(unknown) == 2 * (len(others) - len(flagged))  # the rest: fields with no flag
    c = config_from_args(args)
    assert {name: getattr(c, name) for name in flagged} == flagged
