"""`tokenloop-cli`: generate, chat, info, tokenize, embed, health and bench against a tokenloop server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from . import __version__, cli_bench
from ._channel import DEFAULT_ADDRESS, check_address
from ._cli_help import (
    INCOMPLETE,
    IncompleteOutput,
    Parser,
    UsageError,
    check_complete,
    check_tls_files,
    describe_target,
    non_negative,
    positive,
    report,
    short,
)
from ._gen.messages import ChatMessage
from .client import Client
from .errors import ParameterError, TokenloopError, UnavailableError
from .types import GenerateResult

HEALTH_POLL_S = 0.5  # health --wait: seconds between checks
HEALTH_REPORT_S = 5.0  # health --wait: seconds between progress lines on stderr


def client_kwargs(args: argparse.Namespace) -> dict:
    names = ("api_key", "tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "timeout")
    return {name: getattr(args, name) for name in names}


def _params(args: argparse.Namespace) -> dict:
    names = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "ignore_eos", "json_object",
             "regex", "lora")
    values = {name: getattr(args, name, None) for name in names}
    for name in ("json_schema", "grammar"):  # given as files
        if getattr(args, name, None) is not None:
            values[name] = _read_file(getattr(args, name), f"--{name.replace('_', '-')}")
    # unset options stay unset (server defaults); 0 and 0.0 are real values (temperature 0 = greedy)
    return {name: v for name, v in values.items() if v is not None and v is not False and v != []}


def _read_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror}") from None


def _summary(result: GenerateResult) -> str:
    c = result.completions[0]
    return (f"[{c.finish_reason.value} · {c.usage.prompt_tokens} prompt + {result.usage.completion_tokens} "
            f"completion tokens · ttft {c.timing.ttft_s:.3f}s · total {c.timing.total_s:.3f}s · "
            f"id {result.request_id}]")


def cmd_generate(client: Client, args: argparse.Namespace) -> None:
    """Generate once; with --stream print text as it arrives."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    source = {"messages": [ChatMessage("user", prompt)]} if args.chat else {"prompt": prompt}
    if args.stream:
        with client.stream(**source, **_params(args)) as stream:
            for delta in stream:
                if delta.index == 0:
                    print(delta.text, end="", flush=True)
            result = stream.result
        print()
        extra = result.completions[1:]
    else:
        result = client.generate(**source, **_params(args))
        extra = result.completions if len(result.completions) > 1 else ()
        if not extra:
            print(result.text)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), default=str, ensure_ascii=False))
    for c in extra:
        print(f"--- sequence {c.index} ({c.finish_reason.value}) ---\n{c.text}")
    if not args.quiet:
        print(_summary(result), file=sys.stderr)
    check_complete(result, args)


def cmd_chat(client: Client, args: argparse.Namespace) -> None:
    """Interactive chat: keeps the conversation, streams each reply. /reset clears, /exit quits."""
    interactive = sys.stdin.isatty()
    history = [ChatMessage("system", args.system)] if args.system else []
    if interactive:
        print("chat with the model; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append(ChatMessage("user", line))
        reply = _chat_turn(client, history, args)
        history.append(ChatMessage("assistant", reply))


def _chat_turn(client: Client, history: list[ChatMessage], args: argparse.Namespace) -> str:
    parts = []
    print("assistant> " if sys.stdin.isatty() else "", end="", flush=True)
    stream = client.chat(history, stream=True, **_params(args))
    try:
        for delta in stream:
            parts.append(delta.text)
            print(delta.text, end="", flush=True)
    except KeyboardInterrupt:
        stream.cancel()
    print(flush=True)
    return "".join(parts)


def cmd_info(client: Client, args: argparse.Namespace) -> None:
    """Print the model, the server's limits and its load."""
    info = {"model": dataclasses.asdict(client.model_info()), "load": dataclasses.asdict(client.load()),
            "health": client.health()}
    if args.json:
        print(json.dumps(info, indent=2))
        return
    for section, values in info.items():
        if isinstance(values, str):
            print(f"{section}: {values}")
            continue
        print(f"{section}:")
        for key, value in values.items():
            print(f"  {key:<24} {value}")


def cmd_tokenize(client: Client, args: argparse.Namespace) -> None:
    """Print the token ids (and pieces) of a text or of a one-message chat."""
    res = client.tokenize(messages=[ChatMessage("user", args.text)]) if args.chat else client.tokenize(args.text)
    if args.json:
        print(json.dumps(dataclasses.asdict(res), ensure_ascii=False))
        return
    if res.text:
        print(f"rendered: {res.text!r}")
    print(f"{len(res.token_ids)} tokens")
    for token_id, piece in zip(res.token_ids, res.tokens):
        print(f"{token_id:>8}  {piece!r}")


def cmd_embed(client: Client, args: argparse.Namespace) -> None:
    """Print the embedding of a text ('-' reads stdin): one line of numbers, or the whole result as JSON."""
    text = sys.stdin.read() if args.text == "-" else args.text
    res = client.embed(text, pooling=args.pooling, normalize=args.normalize)
    if args.json:
        print(json.dumps(dataclasses.asdict(res)))
        return
    print(" ".join(f"{x:.6g}" for x in res.embedding))
    if not args.quiet:
        print(f"[{len(res.embedding)} dimensions · {res.pooling} pooling{' · normalized' if res.normalized else ''} "
              f"· {res.prompt_tokens} prompt tokens · id {res.request_id}]", file=sys.stderr)


def cmd_health(client: Client, args: argparse.Namespace) -> None:
    """Print the grpc.health.v1 status; exit 1 unless SERVING. With --wait S, poll until SERVING for up to S s,
    with a progress line on stderr every few seconds."""
    start = time.monotonic()
    deadline, next_report = start + (args.wait or 0.0), start  # a first line at the first miss
    while True:
        try:
            status, why = client.health(args.service), ""
        except UnavailableError as err:  # not listening yet (or any more)
            if time.monotonic() >= deadline:
                raise
            status, why = None, err.message
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        if time.monotonic() >= next_report:
            state = f"status {status}" if status else f"no answer ({short(why)})"
            print(f"health: waiting for {describe_target(args)}: {state}; {time.monotonic() - start:.0f} s of "
                  f"{args.wait:g} s", file=sys.stderr, flush=True)
            next_report += HEALTH_REPORT_S
        time.sleep(HEALTH_POLL_S)
    print(status)
    if status != "SERVING":
        raise SystemExit(1)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive, help="most tokens to generate (>= 1; the server's limit: "
                                                           "`info`)")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="0 = off")
    p.add_argument("--seed", type=non_negative, help="0 to 2**64 - 1; the same seed gives the same output")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    p.add_argument("--lora", metavar="NAME", help="generate with this loaded LoRA adapter (see `lora list`)")
    s = p.add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE",
                   help='constrain the output to JSON valid under the schema in FILE, bounded like {"type": "object", '
                        '"properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": '
                        '"integer", "minimum": 0, "maximum": 99999999}}, "required": ["city", "population"]}; '
                        "what a schema leaves open the server bounds (no keys it does not list, strings <= 128 "
                        "characters, ...: docs/structured-output.md)")
    s.add_argument("--json-object", action="store_true",
                   help="constrain the output to one JSON object (at most 8 keys, bounded values)")
    s.add_argument("--regex", help="constrain the output to match this regular expression")
    s.add_argument("--grammar", metavar="FILE", help="constrain the output to this grammar (GBNF or Lark)")


def _global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """Connection options. On the top parser with defaults and help; on every sub-command too (hidden, no
    default), so that `tokenloop-cli info --address HOST:PORT` works as well as `tokenloop-cli --address ... info`."""
    def add(*names, default=None, **kw):
        if not top:
            kw.update(default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif default is not None:
            kw["default"] = default
        p.add_argument(*names, **kw)

    add("--address", default=os.environ.get("TOKENLOOP_ADDRESS", DEFAULT_ADDRESS), metavar="HOST:PORT",
        help=f"the server (default $TOKENLOOP_ADDRESS or {DEFAULT_ADDRESS}; no port: 50051; https://... turns on TLS)")
    add("--api-key", default=os.environ.get("TOKENLOOP_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (default $TOKENLOOP_API_KEY)")
    add("--tls", action="store_true", help="use TLS with the system's root certificates")
    add("--tls-ca", metavar="PEM", help="CA certificate to verify the server; implies TLS")
    add("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (with --tls-key)")
    add("--tls-key", metavar="PEM", help="client private key for mutual TLS (with --tls-cert)")
    add("--tls-server-name", metavar="NAME", help="expected server name in its certificate")
    add("--timeout", type=float, metavar="S", help="per-call deadline in seconds")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for tokenloop-cli."""
    p = Parser(prog="tokenloop-cli", description="Talk to a tokenloop server.",
                                epilog="`tokenloop-cli COMMAND --help` for a command's options; exit status: 0 ok, "
                                       "1 the server refused or failed, 2 a usage error, 3 a structured output "
                                       "cut off at LENGTH, 130 Ctrl-C. Docs: docs/clients.md")
    p.add_argument("-V", "--version", action="version", version=f"tokenloop-cli {__version__}")
    _global_options(p, top=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, top=False)
    parents = [common]
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", parents=parents, help="generate from a prompt ('-' reads stdin)")
    g.add_argument("prompt")
    g.add_argument("--stream", action="store_true", help="print text as it arrives")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    g.add_argument("-n", "--n", type=positive, help="number of sequences (>= 1)")
    g.add_argument("--json", action="store_true", help="also print the whole result as JSON")
    g.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    _add_sampling(g)

    c = sub.add_parser("chat", parents=parents, help="interactive chat that keeps the conversation")
    c.add_argument("--system", help="system prompt")
    _add_sampling(c)

    i = sub.add_parser("info", parents=parents, help="model, limits, load and health")
    i.add_argument("--json", action="store_true")

    t = sub.add_parser("tokenize", parents=parents, help="token ids of a text")
    t.add_argument("text")
    t.add_argument("--chat", action="store_true", help="render as a user message with the chat template")
    t.add_argument("--json", action="store_true")

    e = sub.add_parser("embed", parents=parents, help="the embedding of a text ('-' reads stdin)")
    e.add_argument("text")
    e.add_argument("--pooling", choices=("last", "mean"), help="the last token's hidden state or the mean over the "
                                                             "prompt (default: the server's)")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="scale to unit L2 norm (default: the server's)")
    e.add_argument("--json", action="store_true", help="print the whole result as JSON")
    e.add_argument("--quiet", action="store_true", help="no summary line on stderr")

    h = sub.add_parser("health", parents=parents, help="grpc.health.v1 status (exit 1 unless SERVING)")
    h.add_argument("--service", default="", help="service name ('' = the whole server)")
    h.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for SERVING (a server that is starting or loading its model)")

    cli_bench.add_parser(sub, parents)
    lo = sub.add_parser("lora", parents=parents, help="list, load or unload LoRA adapters")
    lsub = lo.add_subparsers(dest="lora_command", required=True, metavar="list|load|unload")
    lsub.add_parser("list", parents=parents, help="the adapters the server serves").add_argument(
        "--json", action="store_true")
    ll = lsub.add_parser("load", parents=parents, help="load a PEFT adapter directory (a path on the server) as NAME")
    ll.add_argument("name")
    ll.add_argument("path", help="the adapter's directory as the server sees it: under one of its --lora-root "
                                 "directories (relative: under each)")
    ll.add_argument("--id", type=int, help="its integer id, the router API's lora_config.task_id (default: next free)")
    lu = lsub.add_parser("unload", parents=parents, help="unload an adapter no request is using")
    lu.add_argument("name")
    return p


def cmd_lora(client: Client, args: argparse.Namespace) -> None:
    """LoRA adapters: list, load, unload."""
    if args.lora_command == "load":
        try:
            adapters = [client.load_lora_adapter(args.name, args.path, id=args.id)]
        except TokenloopError as err:  # the server elides file paths from messages; this one is what was typed
            err.message = err.message.replace("<path>", args.path).replace("`path` names", f"{args.path} names")
            if "not a directory" in err.message or "not a PEFT adapter" in err.message:
                err.message += " (the path is read on the server's machine; a relative one from its working directory)"
            raise
    elif args.lora_command == "unload":
        adapters = [client.unload_lora_adapter(args.name)]
    else:
        adapters = client.list_lora_adapters()
    if getattr(args, "json", False):
        print(json.dumps([dataclasses.asdict(a) for a in adapters], indent=2))
        return
    if not adapters:  # `list` on a server with none
        print("no adapters loaded (load one: tokenloop-cli lora load NAME PATH)")
        return
    verb = {"load": "loaded ", "unload": "unloaded "}.get(args.lora_command, "")
    for a in adapters:
        print(f"{verb}{a.name}  id={a.id} rank={a.rank} alpha={a.alpha:g} targets={','.join(a.target_modules)} "
              f"running={a.num_running}  {a.path}")


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "tokenize": cmd_tokenize,
            "embed": cmd_embed, "health": cmd_health, "lora": cmd_lora}


def main(argv: list[str] | None = None) -> int:
    """Entry point of tokenloop-cli: exit 0, 1 (the server refused or failed), 2 (usage), 3 (incomplete), 130."""
    args = build_parser().parse_args(argv)
    try:
        check_address(args.address)
        check_tls_files(args)
        if args.command == "bench":
            return cli_bench.run(args)
        with Client(args.address, **client_kwargs(args)) as client:
            COMMANDS[args.command](client, args)
    except TokenloopError as err:
        report(err, args)
        return 1
    except IncompleteOutput:  # the text and the message are out already
        return INCOMPLETE
    except (UsageError, ParameterError, ValueError) as err:
        print(f"tokenloop-cli: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
