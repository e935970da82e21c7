"""Hostile grammar compiles: what llguidance's own limits bound, and what the server does with the rest.

    .venv/bin/python bench/grammar_bounds.py --model models/SmolLM2-135M-Instruct

1. Compile time of hostile constraints (with the model's tokenizer), each in a process of its own killed at
   `--cap` seconds: with llguidance's default `LLParserLimits`, and with every limit tightened tenfold or more.
   A limit that bounds a case ends it early with an error; one that does not leaves its time unchanged.
2. A real `tokenloop serve` (default flags: 2 compile processes, --grammar-compile-timeout 10): the time a
   Tokenize of a 3,000-character prompt and a cached-schema Generate take, idle and while two 500-patternProperties
   compiles run; when those compiles are refused.
3. Shutdown: seconds from SIGTERM to exit during such a compile, and from the second SIGTERM / SIGINT to exit with
   a stream in flight (--shutdown-grace 30).

Prints Markdown tables; `--out FILE` also writes the figures as JSON (bench/results-grammar-bounds.json).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.results import add_out_argument, machine, write  # noqa: E402


def _patterns(n: int) -> str:
    return json.dumps({"type": "object", "patternProperties": {f"^k{i}_[a-z]+$": {"type": "integer"}
                                                               for i in range(n)}})


CASES = {
    "patternProperties x500": ("json_schema", _patterns(500)),
    "patternProperties x200": ("json_schema", _patterns(200)),
    "nested objects x60": ("json_schema", '{"type": "object", "properties": {"a": ' * 60 + "{}" + "}}" * 60),
    "enum of 20,000 strings": ("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(20000)]})),
    "anyOf of 2,000 objects": ("json_schema", json.dumps({"anyOf": [
        {"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]} for i in range(2000)]})),
    "regex of 5,000 alternatives": ("regex", "(" + "|".join(f"w{i}x[a-z]{{2,5}}" for i in range(5000)) + ")+"),
    "regex [a-z]{1,3000}(x|y){500}": ("regex", "[a-z]{1,3000}(x|y){500}"),
    "Lark rule of 20,000 alternatives": ("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(20000)) + "\n"),
    "Lark chain of 5,000 rules": ("grammar", "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1} | "y"'
                                                                      for i in range(5000)) + '\nr5000: "z"\n'),
}
TIGHT = {"max_items_in_row": 200, "initial_lexer_fuel": 50_000, "step_lexer_fuel": 20_000, "step_max_items": 5_000,
         "max_lexer_states": 10_000, "max_grammar_size": 20_000}

_CHILD = """
import json, sys, threading, time, llguidance
sys.path.insert(0, {root!r})
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.looper import structured as S

def main():
    tok, card = Tokenizer.from_dir({model!r}), ModelCard.from_dir({model!r})
    kind, spec, limits = json.loads(sys.stdin.read())
    compiler = S.GrammarCompiler(tok.to_json(), tok.vocab_size, card.eos_token_ids, 0)
    start = time.perf_counter()
    try:
        text = S.grammar_text(kind, spec)
        lim = llguidance.LLParserLimits(**limits) if limits else None
        matcher = llguidance.LLMatcher(compiler.tokenizer, text, log_level=0, limits=lim)
        compiler._probe(S.Grammar(kind, matcher, tok.vocab_size))
        verdict = "compiles"
    except S.GrammarError as exc:
        verdict = "refused: " + S.one_line(str(exc), 90)
    print(json.dumps({{"s": time.perf_counter() - start, "verdict": verdict}}))

threading.stack_size(256 << 20)  # as the server's compile threads and processes: llguidance recurses per rule
worker = threading.Thread(target=main)
worker.start()
worker.join()
"""


def compile_time(model: str, kind: str, spec: str, limits: dict | None, cap: float) -> dict:
    """{"s", "verdict"} of one compile in a process of its own, killed at `cap` seconds."""
    code = _CHILD.format(root=str(ROOT), model=model)
    try:
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps([kind, spec, limits]), text=True,
                              capture_output=True, timeout=cap + 10)  # + the tokenizer's load
    except subprocess.TimeoutExpired:
        return {"s": None, "verdict": f"killed at {cap:g} s"}
    if done.returncode != 0:
        return {"s": None, "verdict": f"crashed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout)


def part_limits(model: str, cap: float) -> list[dict]:
    rows = []
    print("| case | default limits | tightened limits |\n|---|---|---|")
    for name, (kind, spec) in CASES.items():
        default = compile_time(model, kind, spec, None, cap)
        tight = compile_time(model, kind, spec, TIGHT, cap)
        rows.append({"case": name, "default": default, "tight": tight})
        cell = [f"{r['s']:.2f} s, {r['verdict']}" if r["s"] is not None else r["verdict"] for r in (default, tight)]
        print(f"| {name} | {cell[0]} | {cell[1]} |", flush=True)
    return rows


class Server:
    """`tokenloop serve` on a free port, its log collected."""

    def __init__(self, model: str, *flags: str):
        from tests.e2e.live_server import free_port, tokenloop_command
        self.port = free_port()
        self.proc = subprocess.Popen([*tokenloop_command(), "serve", "--model", model, "--port", str(self.port),
                                      *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300):
            raise RuntimeError("".join(self.lines[-20:]))

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.ready.set() if "tokenloop ready" in line else None

    def stub(self):
        import grpc

        from tokenloop.v1 import tokenloop_pb2_grpc
        return tokenloop_pb2_grpc.TextGenerationStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def exit_time(self, *signals: int) -> float | str:
        """Seconds from the last of `signals` (0.5 s apart) to the process's exit; SIGKILL after 120 s."""
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.5)
            self.proc.send_signal(sig)
            start = time.monotonic()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "still running after 120 s: SIGKILL"
        return time.monotonic() - start


def _timed(fn) -> float | str:
    """Seconds `fn()` took, or its gRPC error (e.g. "DEADLINE_EXCEEDED after 30.0 s")."""
    import grpc
    start = time.perf_counter()
    try:
        fn()
    except grpc.RpcError as err:
        return f"{err.code().name} after {time.perf_counter() - start:.1f} s"
    return time.perf_counter() - start


def _median(fn, times: int) -> float | str:
    """The median of `times` runs, or the first error."""
    figures = []
    for _ in range(times):
        figure = _timed(fn)
        if isinstance(figure, str):
            return figure
        figures.append(figure)
    return statistics.median(figures)


def part_server(model: str) -> dict:
    import grpc

    from tokenloop.v1 import tokenloop_pb2 as pb
    out: dict = {}
    prompt = ("The quick brown fox jumps over the lazy dog. " * 67)[:3000]
    cached = pb.GenerateRequest(text="Answer:", json_schema='{"type": "object", "properties": {"a": {"type": '
                                '"integer"}}, "required": ["a"]}', stopping=pb.StoppingCriteria(max_new_tokens=4))
    server = Server(model)
    stub = server.stub()
    tokenize = lambda: stub.Tokenize(pb.TokenizeRequest(text=prompt), timeout=30)  # noqa: E731
    generate = lambda request: list(stub.Generate(request, timeout=30))  # noqa: E731
    generate(cached)
    out["tokenize_idle_s"] = _median(tokenize, 5)
    out["cached_generate_idle_s"] = _median(lambda: generate(cached), 3)
    refusals: list = []

    def slow(i):
        start = time.perf_counter()
        request = pb.GenerateRequest(text="Answer:", json_schema=_patterns(500).replace("^k", f"^{'kq'[i]}"))
        try:
            generate(request)
            refusals.append(("OK", round(time.perf_counter() - start, 2)))
        except grpc.RpcError as err:
            refusals.append((err.code().name, round(time.perf_counter() - start, 2)))
    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    out["tokenize_during_2_slow_compiles_s"] = _median(tokenize, 5)
    out["cached_generate_during_2_slow_compiles_s"] = _median(lambda: generate(cached), 3)
    for t in threads:
        t.join()
    out["slow_compiles_refused"] = refusals
    out["sigterm_after_slow_compiles_exit_s"] = server.exit_time(signal.SIGTERM)

    server = Server(model, "--grammar-compile-timeout", "120")
    threading.Thread(target=lambda: _ignore(generate, server.stub(), pb.GenerateRequest(
        text="Answer:", json_schema=_patterns(500))), daemon=True).start()
    time.sleep(2.0)
    out["sigterm_during_compile_exit_s"] = server.exit_time(signal.SIGTERM)
    out["sigterm_during_compile_exit_code"] = server.proc.returncode
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = Server(model, "--shutdown-grace", "30")
        s = server.stub()
        stream = s.Generate(pb.GenerateRequest(text="Count:", stream=True, stopping=pb.StoppingCriteria(
            max_new_tokens=4000, ignore_eos=True)), timeout=120)
        next(stream)
        threading.Thread(target=lambda st=stream: _ignore(list, st), daemon=True).start()
        out[f"{sig.name.lower()}_x2_streaming_exit_s"] = server.exit_time(sig, sig)
        out[f"{sig.name.lower()}_x2_streaming_exit_code"] = server.proc.returncode
    return out


def _ignore(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the server went away: expected
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--cap", type=float, default=60.0, help="seconds a compile may run in part 1")
    parser.add_argument("--skip-limits", action="store_true", help="only parts 2 and 3")
    add_out_argument(parser, "results-grammar-bounds.json")
    args = parser.parse_args()
    figures: dict = {"machine": machine()}
    print(figures["machine"])
    if not args.skip_limits:
        figures["limits"] = part_limits(args.model, args.cap)
    figures["server"] = part_server(args.model)
    print("\n| server figure | value |\n|---|---|")
    for key, value in figures["server"].items():
        print(f"| {key} | {value if not isinstance(value, float) else f'{value:.3f}'} |")
    write(args.out, figures)


if __name__ == "__main__":
    main()
