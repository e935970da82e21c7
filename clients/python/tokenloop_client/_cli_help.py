"""What `tokenloop-cli` says when the user's input or the connection is wrong: one line (or a few hints), no traceback."""

from __future__ import annotations

import argparse
import difflib
import json
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
# a peer that answered but does not speak gRPC's HTTP/2 (an HTTP/1 server's "HTTP/1.0 ..." starts with 'H' = 72)
_NOT_HTTP2 = re.compile(r"Failed parsing HTTP/2|Expected SETTINGS frame", re.IGNORECASE)
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


def answered_but_not(err: TokenloopError) -> str | None:
    """When a connection was made but the peer is not what was dialled: what it is not (a gRPC server, a TLS one)."""
    first = err.message.split(_RETRIED, 1)[0]
    if err.code != grpc.StatusCode.UNAVAILABLE:
        return None
    if _NOT_HTTP2.search(first):
        return "not a gRPC server (it does not speak HTTP/2: an HTTP/1 web server?)"
    if "WRONG_VERSION_NUMBER" in first:
        return "not a TLS server (it answered in plaintext): drop --tls/--tls-ca/https://"
    return None


def report(err: TokenloopError, args: argparse.Namespace) -> None:
    """Print a failed call: the status and message, and for a connection that failed what was tried and hints."""
    if (what := answered_but_not(err)) is not None:
        print(f"error: UNAVAILABLE: something answered at {describe_target(args)}, but {what}: {err.message}\n"
              f"  another address? tokenloop-cli --address HOST:PORT ... (or set $TOKENLOOP_ADDRESS)", file=sys.stderr)
        return
    if not_connected(err):
        print(f"error: UNAVAILABLE: no tokenloop server answered at {describe_target(args)}: {err.message}",
              file=sys.stderr)
        print(connection_hints(args), file=sys.stderr)
        return
    print(f"error: {err.code.name}: {err.message}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """argparse whose "unrecognized arguments" error is the command's own (its usage, the closest option) or, for
    a command's option put before the command, says where it goes."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command(parsed)
            if command is not None and not any(w in command._option_string_actions for w in extras):
                command.unknown(extras)  # a typo after the command: that command's usage, not the top one's
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _command(self, parsed: argparse.Namespace) -> Parser | None:
        """The innermost sub-command parser `parsed` chose (`lora list` -> the `list` parser)."""
        parser, found = self, None
        while True:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            name = getattr(parsed, subs[0].dest, None) if subs else None
            if name is None:
                return found
            parser = found = subs[0].choices[name]

    def unknown(self, extras: list[str]):
        message = f"unrecognized arguments: {' '.join(extras)}"
        options = [o for o in self._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(extras[0].split("=", 1)[0], options, n=1)
        self.error(message + (f" (did you mean {close[0]}?)" if close else ""))

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
    return _integer(text, 1)


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0 (a seed: 0 to 2**64 - 1)."""
    return _integer(text, 0, 2**64 - 1)


def _integer(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be >= {low}; got {value}" if high is None else
                                         f"must be between {low} and {high}; got {value}")
    return value


def short(message: str) -> str:
    """The last clause of a gRPC connection error: `Connection refused`, `Domain name not found`."""
    return message.split(_RETRIED, 1)[0].rstrip("]").rsplit(": ", 1)[-1]


def check_complete(result: GenerateResult, args: argparse.Namespace) -> None:
    """A constrained sequence that ended at LENGTH is cut off mid-structure (not valid JSON): say so, where the text
    stopped (what ran on), and exit 3."""
    flag = next((f"--{name.replace('_', '-')}" for name in CONSTRAINTS if getattr(args, name, None)), None)
    cut = [c for c in result.completions if c.truncated]
    if flag is None or not cut:
        return
    which = ", ".join(str(c.index) for c in cut)
    cause = incomplete_cause(cut[0].text, _schema(args)) if flag in ("--json-schema", "--json-object") else None
    print(f"error: incomplete output: sequence {which} ended at LENGTH after {cut[0].usage.completion_tokens} tokens, "
          f"before the {flag} structure was complete (the text above is cut off).\n"
          + (f"  {cause}\n" if cause else "")
          + "  raise --max-new-tokens, or bound the schema (maxLength for strings, maximum for numbers, maxItems for "
          "arrays, \"additionalProperties\": false for objects): see docs/structured-output.md#bounding-a-schema",
          file=sys.stderr)
    raise IncompleteOutput(which)


def _schema(args: argparse.Namespace) -> dict | None:
    try:
        with open(args.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, TypeError, ValueError):  # --json-object (no file), or unreadable now
        return None
    return schema if isinstance(schema, dict) else None


def _declared_keys(schema) -> set[str]:
    """Every property name the schema lists, at any depth."""
    keys: set[str] = set()
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            keys |= set(schema["properties"])
        for value in schema.values():
            keys |= _declared_keys(value)
    elif isinstance(schema, list):
        for value in schema:
            keys |= _declared_keys(value)
    return keys


def incomplete_cause(text: str, schema: dict | None) -> str | None:
    """What ran on in a JSON text cut off at LENGTH: keys the schema does not list, or the string, number or array
    the text ends inside; None when nothing stands out (the budget was simply too small)."""
    stack: list[list] = []  # open containers: [kind "{" or "[", items so far]
    keys: list[str] = []
    in_string = escaped = is_key = False
    literal = number = ""
    for ch in text:
        if in_string:
            if escaped:
                escaped, literal = False, literal + ch
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if is_key:
                    keys.append(literal)
            else:
                literal += ch
            continue
        if ch == '"':
            in_string, literal, number = True, "", ""
            is_key = bool(stack) and stack[-1][0] == "{" and stack[-1][2]
            continue
        if ch in "-+.eE0123456789":
            number += ch
            continue
        number = ""
        if ch in "{[":
            stack.append([ch, 0, ch == "{"])  # [kind, items, expecting a key]
        elif ch in "}]" and stack:
            stack.pop()
        elif ch == "," and stack:
            stack[-1][1] += 1
            stack[-1][2] = stack[-1][0] == "{"
        elif ch == ":" and stack:
            stack[-1][2] = False
    declared = _declared_keys(schema) if schema is not None else set()
    extra = [k for k in dict.fromkeys(keys) if k not in declared] if declared else []
    if extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        return (f"the object has keys the schema does not list ({shown}): the schema allows them; set "
                "\"additionalProperties\": false")
    if in_string and len(literal) >= 16:
        what = "a key" if is_key else "a string"
        return f"the text ends inside {what} {len(literal)} characters long: give it a \"maxLength\""
    digits = sum(c.isdigit() for c in number)
    if digits >= 10:
        return f"the text ends inside a number {digits} digits long: give it a \"maximum\" (and a \"minimum\")"
    arrays = [items + 1 for kind, items, _ in stack if kind == "["]
    if arrays and max(arrays) >= 8:
        return f"the text ends inside an array of {max(arrays)} items: give it \"maxItems\""
    objects = [items + 1 for kind, items, _ in stack if kind == "{"]
    if objects and max(objects) >= 8 and schema is None:
        return f"the text ends inside an object of {max(objects)} keys: give it \"maxProperties\" (or send a schema)"
    return None
