"""`tokenloop-cli`: generate, chat, info, tokenize, health and bench against a tokenloop server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

from . import bench, report
from ._channel import DEFAULT_ADDRESS
from .aio import AsyncClient
from .client import Client
from .errors import TokenloopError, UnavailableError
from .types import ChatMessage, GenerateResult

HEALTH_POLL_S = 0.5  # health --wait: seconds between checks


def _client_kwargs(args: argparse.Namespace) -> dict:
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
        raise SystemExit(f"tokenloop-cli: {flag} {path}: {exc.strerror}") from None


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


def cmd_health(client: Client, args: argparse.Namespace) -> None:
    """Print the grpc.health.v1 status; exit 1 unless SERVING. With --wait S, poll until SERVING for up to S s."""
    deadline = time.monotonic() + (args.wait or 0.0)
    while True:
        try:
            status = client.health(args.service)
        except UnavailableError:  # not listening yet (or any more)
            if time.monotonic() >= deadline:
                raise
            status = None
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        time.sleep(HEALTH_POLL_S)
    print(status)
    if status != "SERVING":
        raise SystemExit(1)


def cmd_bench(args: argparse.Namespace) -> None:
    """Run one load level per concurrency and report throughput and latency."""
    results = asyncio.run(_bench(args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(report.table(results["results"]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **results}, indent=2)
                    + "\n")
        print(f"results written to {args.out}", file=sys.stderr)
    if args.plot:
        report.plot(results["results"], args.plot, title=args.title or results["server"]["model_id"])
        print(f"plot written to {args.plot}", file=sys.stderr)


async def _bench(args: argparse.Namespace) -> dict:
    show = sys.stderr.isatty() if args.progress is None else args.progress
    async with AsyncClient(args.address, **_client_kwargs(args)) as client:
        info = await client.model_info()
        levels = []
        for concurrency in args.concurrency:
            cfg = bench.BenchConfig(concurrency, args.num_requests, args.duration, args.prompt_tokens,
                                    args.max_new_tokens, args.temperature, not args.no_ignore_eos,
                                    tuple("" if name == "base" else name for name in args.lora))
            levels.append(await bench.run_level(client, cfg, show))
    return {"server": {"address": args.address, **dataclasses.asdict(info)}, "results": levels}


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, help="most tokens to generate")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    p.add_argument("--lora", metavar="NAME", help="generate with this loaded LoRA adapter (see `lora list`)")
    s = p.add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid under this schema")
    s.add_argument("--json-object", action="store_true", help="constrain the output to one JSON object")
    s.add_argument("--regex", help="constrain the output to match this regular expression")
    s.add_argument("--grammar", metavar="FILE", help="constrain the output to this grammar (GBNF or Lark)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for tokenloop-cli."""
    p = argparse.ArgumentParser(prog="tokenloop-cli", description="Talk to a tokenloop server.")
    p.add_argument("--address", default=os.environ.get("TOKENLOOP_ADDRESS", DEFAULT_ADDRESS),
                   help=f"HOST:PORT (default {DEFAULT_ADDRESS}; https://HOST:PORT turns on TLS)")
    p.add_argument("--api-key", default=os.environ.get("TOKENLOOP_API_KEY"),
                   help="sent as 'authorization: Bearer KEY' (default $TOKENLOOP_API_KEY)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server; implies TLS")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", help="client private key (PEM) for mTLS")
    p.add_argument("--tls-server-name", help="expected server name in its certificate")
    p.add_argument("--timeout", type=float, help="per-call deadline in seconds")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a prompt ('-' reads stdin)")
    g.add_argument("prompt")
    g.add_argument("--stream", action="store_true", help="print text as it arrives")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    g.add_argument("-n", "--n", type=int, help="number of sequences")
    g.add_argument("--json", action="store_true", help="also print the whole result as JSON")
    g.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    _add_sampling(g)

    c = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    c.add_argument("--system", help="system prompt")
    _add_sampling(c)

    i = sub.add_parser("info", help="model, limits, load and health")
    i.add_argument("--json", action="store_true")

    t = sub.add_parser("tokenize", help="token ids of a text")
    t.add_argument("text")
    t.add_argument("--chat", action="store_true", help="render as a user message with the chat template")
    t.add_argument("--json", action="store_true")

    h = sub.add_parser("health", help="grpc.health.v1 status (exit 1 unless SERVING)")
    h.add_argument("--service", default="", help="service name ('' = the whole server)")
    h.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for SERVING (a server that is starting or loading its model)")

    b = sub.add_parser("bench", help="load generator: throughput, TTFT and inter-token latency")
    b.add_argument("-c", "--concurrency", type=_concurrency_list, default=[1],
                   help="concurrent streams; a comma list (1,4,16) sweeps (default 1)")
    b.add_argument("-r", "--num-requests", type=int, help="requests per level (default 32 without --duration)")
    b.add_argument("-d", "--duration", type=float, help="seconds per level: stop starting requests after")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="output length in tokens (default 128)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--no-ignore-eos", action="store_true", help="let sequences end at EOS (shorter outputs)")
    b.add_argument("--lora", action="append", default=[], metavar="NAME",
                   help="requests name these LoRA adapters in turn (repeatable; 'base' = no adapter)")
    b.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    b.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE (no file unless asked)")
    b.add_argument("--plot", metavar="PNG", help="draw throughput and latency against concurrency")
    b.add_argument("--title", help="plot title (default: the model id)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress bar on stderr (default: when stderr is a terminal)")
    lo = sub.add_parser("lora", help="list, load or unload LoRA adapters")
    lsub = lo.add_subparsers(dest="lora_command", required=True)
    lsub.add_parser("list", help="the adapters the server serves").add_argument("--json", action="store_true")
    ll = lsub.add_parser("load", help="load a PEFT adapter directory (a path on the server) as NAME")
    ll.add_argument("name")
    ll.add_argument("path")
    ll.add_argument("--id", type=int, help="its integer id, the router API's lora_config.task_id (default: next free)")
    lu = lsub.add_parser("unload", help="unload an adapter no request is using")
    lu.add_argument("name")
    return p


def cmd_lora(client: Client, args: argparse.Namespace) -> None:
    """LoRA adapters: list, load, unload."""
    if args.lora_command == "load":
        adapters = [client.load_lora_adapter(args.name, args.path, id=args.id)]
    elif args.lora_command == "unload":
        adapters = [client.unload_lora_adapter(args.name)]
    else:
        adapters = client.list_lora_adapters()
    if getattr(args, "json", False):
        print(json.dumps([dataclasses.asdict(a) for a in adapters], indent=2))
        return
    verb = {"load": "loaded ", "unload": "unloaded "}.get(args.lora_command, "")
    for a in adapters:
        print(f"{verb}{a.name}  id={a.id} rank={a.rank} alpha={a.alpha:g} targets={','.join(a.target_modules)} "
              f"running={a.num_running}  {a.path}")


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "tokenize": cmd_tokenize,
            "health": cmd_health, "lora": cmd_lora}


def main(argv: list[str] | None = None) -> int:
    """Entry point of tokenloop-cli."""
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.num_requests is None and args.duration is None:
        args.num_requests = 32
    try:
        if args.command == "bench":
            cmd_bench(args)
        else:
            with Client(args.address, **_client_kwargs(args)) as client:
                COMMANDS[args.command](client, args)
    except TokenloopError as err:
        print(f"error: {err.code.name}: {err.message}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
