"""`tokenloop-cli` on a user's mistakes, with no server: one line naming the flag, the exit status, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tokenloop_client import Completion, FinishReason, IncompleteOutputError, Timing, Usage
from tokenloop_client._channel import ChannelConfig, with_port
from tokenloop_client.errors import ParameterError

CLI = [sys.executable, "-m", "tokenloop_client.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    run = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert "Traceback" not in run.stderr, run.stderr
    return run


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--tls-ca", "/nope", "info"], "tokenloop-cli: error: --tls-ca /nope: No such file or directory\n"),
    (["--tls-cert", "/nope", "--tls-key", "/etc/hostname", "info"],
     "tokenloop-cli: error: --tls-cert /nope: No such file or directory\n"),
    (["--tls-cert", "/etc/hostname", "--tls-key", "/nope", "info"],
     "tokenloop-cli: error: --tls-key /nope: No such file or directory\n"),
    (["--tls-ca", "/tmp", "info"], "tokenloop-cli: error: --tls-ca /tmp: is a directory; give the PEM file in it\n"),
    (["--tls-key", "/etc/hostname", "info"],
     "tokenloop-cli: error: --tls-key needs --tls-cert too (the client certificate and its key, for mutual TLS)\n"),
])
def test_tls_file_mistakes_are_one_line_naming_the_flag(args, message):
    run = cli(*args)
    assert (run.returncode, run.stderr, run.stdout) == (2, message, "")


def test_no_server_at_the_address_says_what_was_tried_and_what_to_check():
    port = closed_port()
    run = cli("--address", f"127.0.0.1:{port}", "info")
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    assert lines[0].startswith(f"error: UNAVAILABLE: no tokenloop server answered at 127.0.0.1:{port} (plaintext): ")
    assert "Connection refused" in lines[0]
    assert lines[1:] == [
        f"  is a server running there? start one with: .venv/bin/tokenloop serve --port {port}",
        "  another address? tokenloop-cli --address HOST:PORT ... (or set $TOKENLOOP_ADDRESS)",
        "  a TLS server? add --tls-ca CA.pem (or --tls for a publicly signed certificate)"]


def test_health_wait_reports_progress_then_the_hints():
    port = closed_port()
    run = cli("--address", f"127.0.0.1:{port}", "health", "--wait", "6")
    assert run.returncode == 1
    waiting = [line for line in run.stderr.splitlines() if line.startswith("health: waiting")]
    assert len(waiting) >= 2  # one at the first miss, one every 5 s
    assert waiting[0].startswith(f"health: waiting for 127.0.0.1:{port} (plaintext): no answer (Connection refused); ")
    assert waiting[0].endswith(" of 6 s")
    assert "is a server running there?" in run.stderr


@pytest.mark.parametrize(("address", "target"), [
    ("localhost", "localhost:50051"), ("localhost:7", "localhost:7"), ("https://example.com", "example.com:50051"),
    ("[::1]", "[::1]:50051"), ("[::1]:9", "[::1]:9"), ("::1", "[::1]:50051"), ("unix:/tmp/s", "unix:/tmp/s"),
])
def test_an_address_without_a_port_dials_50051(address, target):
    assert with_port(address.split("://", 1)[-1]) == target
    assert ChannelConfig(address).target == target


def test_the_library_names_the_unreadable_tls_file():
    with pytest.raises(ParameterError) as info:
        ChannelConfig(tls_ca="/nope").credentials()
    assert (info.value.parameter, str(info.value)) == ("tls_ca", "tls_ca /nope: cannot be read (No such file or directory)")


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "x", "-n", "0"], "tokenloop-cli generate: error: argument -n/--n: must be >= 1; got 0"),
    (["bench", "-c", "1,x"], "tokenloop-cli bench: error: argument -c/--concurrency: expected comma-separated "
                             "integers such as 1,4,16; got '1,x'"),
    # the flag's name and one range, not the library's parameter and its uint32 range (issue 44)
    (["generate", "x", "--max-new-tokens", "-5"], "tokenloop-cli generate: error: argument --max-new-tokens: must be "
                                                  ">= 1; got -5"),
    (["generate", "x", "--seed", "-1"], "tokenloop-cli generate: error: argument --seed: must be between 0 and "
                                        "18446744073709551615; got -1"),
    # a typo after the command: that command's error (and usage), with the closest option
    (["generate", "x", "--max-new-tokns", "5"], "tokenloop-cli generate: error: unrecognized arguments: "
                                                "--max-new-tokns 5 (did you mean --max-new-tokens?)"),
    (["lora", "list", "--jsn"], "tokenloop-cli lora list: error: unrecognized arguments: --jsn (did you mean --json?)"),
    # an address gRPC cannot parse was UNAVAILABLE with a `serve --port xx` hint (issue 44)
    (["--address", "not a host:xx", "info"], "tokenloop-cli: error: address 'not a host:xx': the port must be a number "
                                             "from 1 to 65535, not 'xx' (HOST:PORT, e.g. 127.0.0.1:50051)"),
    (["info", "--address", "my host:50051"], "tokenloop-cli: error: address 'my host:50051': 'my host' is not a host "
                                             "name or address (HOST:PORT, e.g. 127.0.0.1:50051)"),
])
def test_usage_mistakes_exit_2_with_the_rule(args, message):
    run = cli(*args)
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == message


def test_global_options_work_after_the_command_too():
    from tokenloop_client.cli import build_parser
    after = build_parser().parse_args(["info", "--address", "h:1", "--timeout", "3"])
    before = build_parser().parse_args(["--address", "h:1", "--timeout", "3", "info"])
    assert (after.address, after.timeout) == (before.address, before.timeout) == ("h:1", 3.0)
    nested = build_parser().parse_args(["lora", "list", "--address", "h:2"])
    assert nested.address == "h:2"
    assert build_parser().parse_args(["info"]).address  # the default survives a sub-command without it


def test_version():
    run = cli("--version")
    assert (run.returncode, run.stdout) == (0, "tokenloop-cli 0.1.0\n")


def test_help_fits_a_screen():
    run = cli("--help")
    assert run.returncode == 0 and len(run.stdout.splitlines()) <= 40


def completion(reason: FinishReason, text: str) -> Completion:
    return Completion(index=0, text=text, finish_reason=reason, usage=Usage(3, 7), timing=Timing())


def test_a_structure_cut_off_at_length_raises_on_json():
    cut = completion(FinishReason.LENGTH, '{"n": 1111')
    assert cut.truncated
    with pytest.raises(IncompleteOutputError) as info:
        cut.json()
    assert str(info.value).startswith("sequence 0 ended at LENGTH after 7 tokens, before its structure was complete")
    assert info.value.completion is cut
    done = completion(FinishReason.STRUCTURE_COMPLETE, '{"n": 1}')
    assert not done.truncated and done.json() == {"n": 1}


def test_a_command_option_before_the_command_says_where_it_goes():
    run = cli("-q", "generate", "x")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-2:] == [
        "tokenloop-cli: error: unrecognized arguments: -q",
        "  -q is an option of generate: put it after the command, e.g. tokenloop-cli generate -q ..."]


@pytest.mark.parametrize(("message", "connected"), [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused", False),
    ("errors resolving nosuch.invalid:1: [Domain name not found]", False),
    ("Socket closed", False),
    ("the server is shutting down", True),
    ("the executor is not available: injected fault (retried 3 times; last: UNAVAILABLE: failed to connect to all "
     "addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused)", True),  # a server answered first
])
def test_hints_only_when_no_server_answered(message, connected):
    import grpc

    from tokenloop_client._cli_help import not_connected
    from tokenloop_client.errors import UnavailableError
    assert not_connected(UnavailableError(grpc.StatusCode.UNAVAILABLE, message)) is not connected


def test_the_library_refuses_n_0_instead_of_running_one_sequence():
    from tokenloop_client._gen import tokenloop_pb2 as pb
    from tokenloop_client._request import GenerationParams
    with pytest.raises(ParameterError) as info:
        GenerationParams(n=0).apply(pb.GenerateRequest())
    assert (info.value.parameter, str(info.value)) == ("n", "`n` must be >= 1 (the number of sequences); got 0")


def test_a_typo_after_the_command_prints_that_commands_usage():
    run = cli("info", "--jsonn")
    assert run.returncode == 2 and run.stderr.startswith("usage: tokenloop-cli info [-h] [--json]"), run.stderr


def test_the_json_schema_help_shows_a_bounded_schema():
    """The example in `generate --help` is JSON, and bounds each of its values (issue 44)."""
    import json

    from tokenloop_client.cli import build_parser
    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    text = next(a for a in generate._actions if a.dest == "json_schema").help
    schema = json.loads(text[text.index("{"):text.index("; ")])
    assert schema["properties"]["city"]["maxLength"] and schema["properties"]["population"]["maximum"]
    assert "docs/structured-output.md" in text


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}


@pytest.mark.parametrize("text, schema, cause", [
    ('{"city": "Paris", "population": 3, "population_density": 2, "x": "y', CITY,
     'the object has keys the schema does not list (population_density, x): the schema allows them; set '
     '"additionalProperties": false'),
    ('{"city": "Paris", "population": 11112222333344445555', CITY,
     'the text ends inside a number 20 digits long: give it a "maximum" (and a "minimum")'),
    ('{"city": "Espresso-Lemon-Lemon-Cinnamon', CITY,
     'the text ends inside a string 29 characters long: give it a "maxLength"'),
    ('{"items": ["a", "b", "c", "d", "e", "f", "g", "h", "i', {"properties": {"items": {}}},
     'the text ends inside an array of 9 items: give it "maxItems"'),
    ('{"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7, "h": 8', None,
     'the text ends inside an object of 8 keys: give it "maxProperties" (or send a schema)'),
    ('{"ci', CITY, None),  # the budget was simply too small: the general advice only
])
def test_a_cut_off_structure_names_what_ran_on(text, schema, cause):
    """The exit-3 hint named bounds in general, not additionalProperties nor what actually ran on (issue 44)."""
    from tokenloop_client._cli_help import incomplete_cause
    assert incomplete_cause(text, schema) == cause


def test_the_quiet_grpc_log_level_is_not_inherited_by_child_processes():
    """tokenloop_client runs gRPC's core at ERROR, but leaves GRPC_VERBOSITY out of the environment it passes on."""
    code = "import os, tokenloop_client, grpc; print(os.environ.get('GRPC_VERBOSITY'))"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (run.returncode, run.stdout) == (0, "None\n"), run.stderr
