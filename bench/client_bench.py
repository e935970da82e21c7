"""`tokenloop-cli bench` (the Python client's load generator) against a `tokenloop serve` of the default model:
throughput, TTFT and inter-token latency per concurrency level (bench/RESULTS-clients.md).

    .venv/bin/tokenloop-bench clients [--concurrency 1,4,16,32] [--duration 60] [--out bench/results-clients.json]

The server is started on a free port and stopped at the end; `--out FILE` writes the client's results stamped
like every results file (date, CPU, commit, command) and its plot beside it (FILE with .png). Timings are only
meaningful on a quiet machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenloop.bench.harness import TokenloopServer, parser, write


def client_bench(address: str, args, out: Path, plot: Path | None) -> list[str]:
    """The `tokenloop-cli bench` command line against `address`, its JSON to `out` (and its plot to `plot`)."""
    return [sys.executable, "-m", "tokenloop_client.cli", "--address", address, "bench",
            "--concurrency", args.concurrency, "--duration", str(args.duration),
            "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.max_new_tokens),
            "--no-progress", "--out", str(out), *(["--plot", str(plot)] if plot else [])]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "results-clients.json")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels (default 1,4,16,32)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per level (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    plot = Path(args.out).with_suffix(".png") if args.out else None
    with tempfile.TemporaryDirectory() as tmp, TokenloopServer(args.model) as server:
        out = Path(tmp) / "clients.json"
        # the table goes to our stdout unless --json; the client's own JSON is read back from its file
        done = subprocess.run(client_bench(server.address, args, out, plot),
                              stdout=subprocess.DEVNULL if args.json else None)
        if done.returncode != 0:
            print(f"tokenloop-cli bench exited {done.returncode}", file=sys.stderr)
            return done.returncode
        figures = json.loads(out.read_text())
    write(args.out, figures)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
