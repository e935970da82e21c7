"""The size table (issue 43): the engine against llama.cpp's llama-server on the same model files as models grow.

    .venv/bin/tokenloop-bench size_table --llama-cpp DIR [--shapes DIR] [--gemma FILE] [--weights int4]

Models: the default SmolLM2-135M (llama-server on the build directory's Q4_1 GGUF), random-weight checkpoints in
the shapes of SmolLM2-360M and SmolLM2-1.7B (speed depends on shapes, not values; made by
../shared/tools/scale_models.py and converted for llama.cpp by its own convert_hf_to_gguf.py and
`llama-quantize ... Q4_1`, made here when `--shapes` lacks them), and with `--gemma` the real Gemma 3 270M Q4_K_M
GGUF served by both from the one file. Each model is one run of the engine benchmark (bench/engine_bench.py, in a
child process: one stream and eight streams of 128 new tokens, EOS ignored, `--single-repeats` medians, the memory
bandwidth measured with the one-stream scenario) with `--weights` for tokenloop and the same scenarios against
llama-server. Targets: the fastest mode >= 1.3x llama-server at one stream and >= 1.2x at eight, every size;
int4 one stream >= 60 % of the bandwidth limit at 1.7B; Gemma >= 1.2x at 1 and 8 streams.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenloop.bench.harness import ROOT, parser, report
from tokenloop.bench.llama_server import GGUF as LLAMA_GGUF

SHAPES = ("smollm2-360m-shape", "smollm2-1.7b-shape")
SCALE_MODELS = ROOT.parent / "shared" / "tools" / "scale_models.py"  # beside the checkout, as the README says


def convert_script(llama_cpp: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in a build_llamacpp.sh directory (its source tree is under src/)."""
    found = sorted(llama_cpp.glob("src/convert_hf_to_gguf.py")) or sorted(llama_cpp.glob("src/*/vendor/llama.cpp/"
                                                                                         "convert_hf_to_gguf.py"))
    if not found:
        sys.exit(f"size_table: no convert_hf_to_gguf.py under {llama_cpp}/src (build it with build_llamacpp.sh)")
    return found[0]


def prepare_shapes(shapes: Path, llama_cpp: Path, base_model: str, scale: Path) -> None:
    """The shapes' checkpoints and their Q4_1 GGUF files, made where missing (minutes; several GB of disk)."""
    if not all((shapes / name / "config.json").exists() for name in SHAPES):
        if not scale.exists():
            sys.exit(f"size_table: --scale-models {scale} does not exist")
        subprocess.run([sys.executable, str(scale), base_model, str(shapes)], check=True)
    for name in SHAPES:
        f16, q41 = shapes / f"{name}.f16.gguf", shapes / f"{name}.Q4_1.gguf"
        if q41.exists():
            continue
        convert = convert_script(llama_cpp)
        subprocess.run([sys.executable, str(convert), str(shapes / name), "--outtype", "f16", "--outfile", str(f16)],
                       check=True)
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(q41), "Q4_1"], check=True)
        f16.unlink()


def run_model(label: str, model: str, gguf: str, weights: str, args) -> dict:
    """One engine-benchmark run on `model` against llama-server on `gguf`; its recorded figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "tokenloop.bench.engine_bench", "--model", model, "--weights", weights,
               "--scenarios", args.scenarios, "--reference", "none", "--single-repeats", str(args.single_repeats),
               "--out", out.name]
        cmd += ["--llama-cpp", args.llama_cpp, "--llama-gguf", gguf] if args.llama_cpp else []
        cmd += ["--new-tokens", str(args.new_tokens)] if args.new_tokens else []
        if args.new_tokens or model.endswith(".gguf"):  # the bandwidth share is the checkpoint shapes' (issue 43)
            cmd.append("--no-bandwidth")
        print(f"{label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=sys.stderr)
        if done.returncode != 0:  # the other models still run; the row says what failed
            return {"model": label, "path": model, "gguf": gguf, "error": f"engine_bench exited {done.returncode}"}
        record = json.loads(Path(out.name).read_text())
    shown = record["issue_32"]
    row = {"model": label, "path": model, "gguf": gguf, "commit": record["commit"]}
    for scenario in ("single", "eight"):
        vs = shown.get(f"vs_llama_{scenario}")
        if vs:
            row[scenario] = {"system": vs["system"], "tok_s": round(vs["tokens_per_s"], 1),
                             "llama_tok_s": round(vs["llama_tokens_per_s"], 1), "ratio": round(vs["ratio"], 3)}
    if "int4_decode_bandwidth_share" in shown:
        row["int4_decode_bandwidth_share"] = round(shown["int4_decode_bandwidth_share"], 3)
    if record.get("bandwidth"):
        row["weight_bytes_per_token"] = record["bandwidth"]["weight_bytes_per_token"]
        row["bandwidth_limit_bytes_per_s"] = record["bandwidth"]["limit_bytes_per_s"]
    row["results"] = [{k: r[k] for k in ("system", "scenario", "tokens_per_s", "ttft_p50_s",
                                          "median_decode_tokens_per_s") if k in r} for r in record["results"]]
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "results-size.json")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="a build_llamacpp.sh directory (without it: tokenloop alone, the default model only)")
    p.add_argument("--scenarios", default="single,eight")
    p.add_argument("--new-tokens", type=int, default=None, help="a quick check (not a figure): new tokens each")
    p.add_argument("--shapes", default="/tmp/tokenloop-shapes", metavar="DIR",
                   help="where the shapes' checkpoints and GGUF files are (made when missing)")
    p.add_argument("--gemma", default=None, metavar="FILE", help="the Gemma 3 270M Q4_K_M GGUF (make model-gemma3)")
    p.add_argument("--gemma-weights", default="int8,int4")
    p.add_argument("--weights", default="int4", help="tokenloop's --weights modes (comma-separated)")
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--scale-models", default=str(SCALE_MODELS), metavar="FILE",
                   help="../shared/tools/scale_models.py (makes the shapes' checkpoints)")
    p.add_argument("--only", default=None, help="comma-separated labels to run (135M, 360M, 1.7B, gemma3-270m)")
    args = p.parse_args(argv)
    if not args.llama_cpp:
        args.only = "135M"
    llama_cpp, shapes = Path(args.llama_cpp or "."), Path(args.shapes)
    models = [("135M", args.model, str(llama_cpp / LLAMA_GGUF))]
    models += [(name.split("-")[1].upper(), str(shapes / name), str(shapes / f"{name}.Q4_1.gguf")) for name in SHAPES]
    if args.gemma:
        models.append(("gemma3-270m", args.gemma, args.gemma))
    if args.only:
        models = [m for m in models if m[0] in args.only.split(",")]
    if any(label in ("360M", "1.7B") for label, _, _ in models):
        prepare_shapes(shapes, llama_cpp, args.model, Path(args.scale_models))
    rows = []
    for label, model, gguf in models:
        rows.append(run_model(label, model, gguf, args.gemma_weights if label.startswith("gemma") else args.weights,
                              args))
    figures = {"weights": args.weights, "gemma_weights": args.gemma_weights, "single_repeats": args.single_repeats,
               "new_tokens": 128, "rows": rows}

    def table() -> str:
        lines = ["| model | 1 stream: ours / llama-server tok/s | ratio | 8 streams: ours / llama-server tok/s | ratio "
                 "| int4 1 stream, share of bandwidth |", "| --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            cells = []
            for scenario in ("single", "eight"):
                vs = row.get(scenario)
                cells += ([f"{vs['system']} {vs['tok_s']} / {vs['llama_tok_s']}", f"{vs['ratio']:.2f}x"] if vs
                          else ["-", "-"])
            share = row.get("int4_decode_bandwidth_share")
            lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {f'{share:.0%}' if share else '-'} |"
                         + (f" {row['error']}" if "error" in row else ""))
        return "\n".join(lines)

    return report(args, figures, table)


if __name__ == "__main__":
    sys.exit(main())
