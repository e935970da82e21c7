"""The bench harness (bench/harness.py): a benchmark writes a file only through `--out FILE`, stamped with the date,
machine, commit and command, so a run never leaves a new file to commit by accident."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tokenloop.bench.__main__ import BENCHMARKS
from tokenloop.bench.harness import write

RECORDED = sorted(name for name, b in BENCHMARKS.items() if b.results)  # benchmarks whose figures are recorded


@pytest.mark.parametrize("name", RECORDED)
def test_every_recorded_benchmark_takes_out_and_writes_nothing_by_default(name):
    run = subprocess.run([sys.executable, "-m", "tokenloop.bench", name, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--out FILE" in run.stdout and "none by default" in " ".join(run.stdout.split())


def test_the_client_bench_takes_out():
    from tokenloop_client.cli import build_parser
    args = build_parser().parse_args(["bench", "--out", "x.json"])
    assert args.out == "x.json"
    assert build_parser().parse_args(["bench"]).out is None


def test_write_stamps_the_date_machine_commit_and_command(tmp_path, capsys, monkeypatch):
    from tokenloop.bench import harness
    write(None, {"a": 1})
    assert capsys.readouterr().out == ""
    out = tmp_path / "r.json"
    monkeypatch.setattr(harness, "COMMAND", ["tokenloop-bench", "engine", "--weights", "int4"])
    write(str(out), {"a": 1})
    data = json.loads(out.read_text())
    assert data["a"] == 1 and data["cpus"] >= 1 and data["date"].endswith("Z") and data["cpu"]
    assert data["command"] == "tokenloop-bench engine --weights int4"
    assert data["commit"] == harness.commit() and data["commit"] != ""


def test_one_current_result_file_per_benchmark():
    """Every results file belongs to a benchmark of `tokenloop-bench` (results-clients.*: `tokenloop-cli bench`)."""
    files = sorted(p.name for p in (ROOT / "bench").glob("results-*"))
    owned = {b.results for b in BENCHMARKS.values()} | {"results-clients.json", "results-clients.png"}
    assert [f for f in files if f not in owned] == []


# /proc/cpuinfo's first processor on the two kinds of VM the project runs on (abridged: the fields cpu_record reads)
ZEN4_VM = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC
stepping	: 1
flags		: fpu sse4_2 avx f16c bmi2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni

processor	: 1
vendor_id	: AuthenticAMD
model name	: a second processor is not read
"""
XEON_VM = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags		: avx avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_cpu_record_names_the_model_family_and_isa_flags():
    from tokenloop.bench.harness import describe
    from tokenloop_client.machine import cpu_record
    amd = cpu_record(ZEN4_VM)
    assert (amd["cpu"], amd["cpu_vendor"], amd["cpu_family"], amd["cpu_model"], amd["cpu_stepping"]) == (
        "AMD EPYC", "AuthenticAMD", 25, 17, 1)
    assert amd["isa"] == ["sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                          "avx512_vnni", "avx512_bf16", "avx512vbmi"]  # in ISA_FLAGS' order; fpu is not one of them
    assert describe(amd).startswith("AMD EPYC (family 25 model 17; sse4_2 avx avx2")
    intel = cpu_record(XEON_VM)
    assert intel["cpu_family"] == 6 and intel["cpu_model"] == 143 and intel["cpu_stepping"] is None
    assert {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"} <= set(intel["isa"]) and "avx512vbmi" not in intel["isa"]
    bare = cpu_record("")
    assert bare["cpu"] and bare["isa"] == [] and bare["cpu_family"] is None
    assert "no flags recorded" in describe(bare)


def test_write_records_this_machines_cpu(tmp_path):
    from tokenloop_client.machine import cpu_record
    out = tmp_path / "r.json"
    write(str(out), {"a": 1})
    data = json.loads(out.read_text())
    assert {k: data[k] for k in cpu_record()} == cpu_record()  # the keys and values of this machine's record


def _file_writes(tree) -> list[str]:
    """The calls in a module that write a file other than through tokenloop.bench.harness.write."""
    import ast
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        positional = node.args[0:1] if isinstance(node.func, ast.Attribute) else node.args[1:2]  # Path.open / open
        mode = [a.value for a in positional if isinstance(a, ast.Constant)] + [
            k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
        if name in ("write_text", "write_bytes", "dump") or (name == "open" and any(set(str(m)) & set("wax") for m in mode)):
            found.append(f"{name} at line {node.lineno}")
    return found


# files a bench writes that are not its figures: soak's Markdown table (its first line is machine()'s record,
# through describe()), service_overhead's per-run emission log, llama_server's server log, attention_bench's copy
# of the kernel source at the base revision (built to compare against)
NOT_FIGURES = {"soak.py": 1, "service_overhead.py": 1, "llama_server.py": 1, "attention_bench.py": 1}
OUT_IS_NOT_FIGURES = {"shape_gguf.py"}  # its --out is the GGUF file it makes, not a results file


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")
                                          if p.name not in ("harness.py", "figures.py")))
def test_every_benchmark_writes_its_figures_through_the_harness(script):
    """Every --out goes through harness.write, which stamps the CPU record, commit and command: no bench writes JSON
    itself (figures.py rewrites the README's table between its markers)."""
    import ast
    source = (ROOT / "bench" / script).read_text()
    assert len(_file_writes(ast.parse(source))) == NOT_FIGURES.get(script, 0), _file_writes(ast.parse(source))
    if ('"--out"' in source or "add_out_argument" in source) and script not in OUT_IS_NOT_FIGURES:
        assert "from tokenloop.bench.harness import" in source
        assert "write(args.out" in source or "write(out," in source or "report(args," in source or script == "soak.py"
    if script == "soak.py":
        assert "describe(where)" in source


def test_the_bandwidth_bench_out_carries_the_machine_record(tmp_path):
    """One bench run for real with --out (the cheapest, on a small model's shapes): its JSON has the CPU record
    beside its figures."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "vocab_size": 256,
                                                   "num_hidden_layers": 2}))
    out = tmp_path / "bw.json"
    run = subprocess.run([sys.executable, "-m", "tokenloop.bench", "bandwidth", "--model", str(model), "--mb", "16",
                          "--rounds", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["cpu"] and data["cpu_family"] is not None and "isa" in data and data["date"].endswith("Z")
    assert data["command"].startswith("tokenloop-bench bandwidth --model ")  # as the runner started it
    figures = data["bandwidth"]
    assert figures["limit_bytes_per_s"] == max(figures["methods"].values()) > 0
    assert figures["weight_bytes_per_token"]["int4"] < figures["weight_bytes_per_token"]["int8"] \
        < figures["weight_bytes_per_token"]["fp32"]


STAMP = ("date", "commit", "cpu", "command")  # what harness.write adds to every results file
# Results files written before harness.write stamped every run (or put together by hand from several runs): each
# needs a rerun on a quiet machine with this command, which writes it stamped; then it leaves this list.
AWAITING_RERUN = {
    "results-structured.json": "tokenloop-bench structured --out bench/results-structured.json",
    "results-shared-prefix.json": "tokenloop-bench shared_prefix --out bench/results-shared-prefix.json",
    "results-lora.json": "tokenloop-bench lora --out bench/results-lora.json",
    "results-engine-gil.json": "tokenloop-bench engine_gil --streams 16 --out bench/results-engine-gil.json "
                               "(the file held 16 and 32 streams: one run per file now)",
    "results-prompt-stall.json": "tokenloop-bench prompt_stall --out bench/results-prompt-stall.json",
    "results-quant-kernels.json": "tokenloop-bench quant_kernels --weights fp32,int8,int4 "
                                  "--out bench/results-quant-kernels.json",
    "results-grammar-libs.json": "tokenloop-bench grammar_libs --out bench/results-grammar-libs.json",
    "results-overhead.json": "tokenloop-bench service_overhead --out bench/results-overhead.json (the file held six "
                             "runs; README's overhead figures read that list)",
    "results-clients.json": "tokenloop serve --port 50051 & tokenloop-cli bench --concurrency 1,4,16,32 --duration 60 "
                            "--prompt-tokens 64 --max-new-tokens 128 --out bench/results-clients.json "
                            "--plot bench/results-clients.png",
}
CLIENT_STAMP = ("date", "cpu")  # results-clients.json: `tokenloop-cli bench`, which knows no server commit


def test_every_results_file_carries_the_date_commit_cpu_and_command():
    """A figure's provenance is in its file (CONTRIBUTING.md, STYLE.md "Figures are data"); the files written before
    the stamp wait for a quiet rerun (AWAITING_RERUN, listed with their commands), and one rerun leaves the list."""
    for path in sorted((ROOT / "bench").glob("results-*.json")):
        data = json.loads(path.read_text())
        record = data[0] if isinstance(data, list) else data
        need = CLIENT_STAMP if path.name == "results-clients.json" else STAMP
        missing = [key for key in need if key not in record]
        if path.name in AWAITING_RERUN:
            assert missing, f"{path.name} is stamped now: drop it from AWAITING_RERUN"
        else:
            assert not missing, f"bench/{path.name} lacks {missing}: rerun it (harness.write stamps it)"
    assert set(AWAITING_RERUN) <= {p.name for p in (ROOT / "bench").glob("results-*.json")}
