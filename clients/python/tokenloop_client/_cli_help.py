"""What `tokenloop-cli` says when the user's input or the connection is wrong: one line (or a few hints), no traceback."""

from __future__ import annotations

import argparse
import os
import re
import sys

import grpc

from ._channel import with_port
from .errors import TokenloopError
from .types import GenerateResult

INCOMPLETE = 3  # exit status: a constrained sequence ended at LENGTH (its structure is incomplete)
CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar")
TLS_FILE_FLAGS = (("tls_ca", "--tls-ca"), ("tls_cert", "--tls-cert"), ("tls_key", "--tls-key"))
# what gRPC says in an UNAVAILABLE status when no connection was made (as opposed to a server that answered it)
_NOT_CONNECTED = re.compile(r"failed to connect|connection refused|errors resolving|dns resolution|socket closed|"
                            r"handshake|connections to all backends failing|connection reset|end of tcp stream|"
                            r"\bssl\b|\btls\b", re.IGNORECASE)
_RETRIED = " (retried "  # the client's suffix after retries: `first status (retried N times; last: ...)`


class UsageError(Exception):
    """A mistake on the command line: the message says what to type instead; exit status 2."""


class IncompleteOutput(Exception):
    """A constrained sequence ended at LENGTH: its text is cut off mid-structure; exit status 3."""


def check_tls_files(args: argparse.Namespace) -> None:
    """Each TLS file flag names a readable file; the pair --tls-cert/--tls-key comes together."""
    for name, flag in TLS_FILE_FLAGS:
        path = getattr(args, name, None)
        if path is None:
            continue
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a directory; give the PEM file in it")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    if (args.tls_cert is None) != (args.tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if args.tls_key is None else ("--tls-key", "--tls-cert")
        raise UsageError(f"{given} needs {missing} too (the client certificate and its key, for mutual TLS)")


def describe_target(args: argparse.Namespace) -> str:
    """`127.0.0.1:50051 (plaintext)` or `... (TLS)`: what the CLI dialled."""
    secure = bool(args.tls or args.tls_ca or args.tls_cert or args.address.startswith("https://"))
    return f"{with_port(args.address.split('://', 1)[-1])} ({'TLS' if secure else 'plaintext'})"


def not_connected(err: TokenloopError) -> bool:
    """True when an UNAVAILABLE error means no connection was made (not a server that answered UNAVAILABLE)."""
    first = err.message.split(_RETRIED, 1)[0]  # the first attempt's status: a server's own reason, if one answered
    return err.code == grpc.StatusCode.UNAVAILABLE and _NOT_CONNECTED.search(first) is not None


def connection_hints(args: argparse.Namespace) -> str:
    """What to check when nothing answered at the address."""
    secure = describe_target(args).endswith("(TLS)")
    port = with_port(args.address.split("://", 1)[-1]).rsplit(":", 1)[-1]
    tls = ("the server may not use TLS: drop --tls/--tls-ca/https://" if secure else
           "a TLS server? add --tls-ca CA.pem (or --tls for a publicly signed certificate)")
    return (f"  is a server running there? start one with: .venv/bin/tokenloop serve --port {port}\n"
            f"  another address? tokenloop-cli --address HOST:PORT ... (or set $TOKENLOOP_ADDRESS)\n"
            f"  {tls}")


def report(err: TokenloopError, args: argparse.Namespace) -> None:
    """Print a failed call: the status and message, and for a connection that failed what was tried and hints."""
    if not_connected(err):
        print(f"error: UNAVAILABLE: no tokenloop server answered at {describe_target(args)}: {err.message}",
              file=sys.stderr)
        print(connection_hints(args), file=sys.stderr)
        return
    print(f"error: {err.code.name}: {err.message}", file=sys.stderr)



class Parser(argparse.ArgumentParser):
    """argparse whose "unrecognized arguments" error says where a command's own option goes."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            owners = {}
            for action in self._actions:
                for name, sub in getattr(action, "choices", None).items() if isinstance(
                        action, argparse._SubParsersAction) else ():
                    for option in sub._option_string_actions:
                        owners.setdefault(option, []).append(name)
            words = message.split(": ", 1)[1].split()
            known = [(w, owners[w]) for w in words if w in owners and w not in self._option_string_actions]
            if known:
                word, commands = known[0]
                message += f"\n  {word} is an option of {', '.join(commands)}: put it after the command, " \
                           f"e.g. tokenloop-cli {commands[0]} {word} ..."
        super().error(message)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def short(message: str) -> str:
    """The last clause of a gRPC connection error: `Connection refused`, `Domain name not found`."""
    return message.split(_RETRIED, 1)[0].rstrip("]").rsplit(": ", 1)[-1]


def check_complete(result: GenerateResult, args: argparse.Namespace) -> None:
    """A constrained sequence that ended at LENGTH is cut off mid-structure (not valid JSON): say so, exit 3."""
    flag = next((f"--{name.replace('_', '-')}" for name in CONSTRAINTS if getattr(args, name, None)), None)
    cut = [c for c in result.completions if c.truncated]
    if flag is None or not cut:
        return
    which = ", ".join(str(c.index) for c in cut)
    print(f"error: incomplete output: sequence {which} ended at LENGTH after {cut[0].usage.completion_tokens} tokens, "
          f"before the {flag} structure was complete (the text above is cut off).\n"
          "  raise --max-new-tokens, or bound the schema (maxLength for strings, maximum for numbers, maxItems for "
          "arrays): see docs/structured-output.md", file=sys.stderr)
    raise IncompleteOutput(which)
