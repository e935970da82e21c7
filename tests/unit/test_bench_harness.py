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
    """Every results file belongs to a benchmark of `tokenloop-bench` (results-clients.png: the clients one's plot)."""
    files = sorted(p.name for p in (ROOT / "bench").glob("results-*"))
    owned = {b.results for b in BENCHMARKS.values()} | {"results-clients.png"}
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
# shape_gguf's --out is the GGUF file it makes, not a results file; __main__ passes --out on to `record`'s benchmarks
OUT_IS_NOT_FIGURES = {"shape_gguf.py", "__main__.py"}


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
# Benchmarks whose results files were written before harness.write stamped every run (or put together by hand from
# several runs): each needs a rerun on a quiet machine, all of them in one command (RERUN, given in bench/README.md),
# which writes each file stamped; a benchmark whose file is stamped leaves this list.
AWAITING_RERUN: tuple[str, ...] = ()  # the nine rerun on the quiet VM, 2026-12-07 07:22-07:36 UTC (tokenloop-bench record)
RERUN = "tokenloop-bench record " + " ".join(AWAITING_RERUN)


def test_every_results_file_carries_the_date_commit_cpu_and_command():
    """A figure's provenance is in its file (CONTRIBUTING.md, STYLE.md "Figures are data"); the files written before
    the stamp wait for a quiet rerun (AWAITING_RERUN, all rerun by one command), and one rerun leaves the list."""
    stale = {BENCHMARKS[name].results: name for name in AWAITING_RERUN}
    for path in sorted((ROOT / "bench").glob("results-*.json")):
        data = json.loads(path.read_text())
        record = data[0] if isinstance(data, list) else data
        missing = [key for key in STAMP if key not in record]
        if path.name in stale:
            assert missing, f"{path.name} is stamped now: drop {stale[path.name]} from AWAITING_RERUN"
        else:
            assert not missing, f"bench/{path.name} lacks {missing}: rerun it (harness.write stamps it)"
    assert set(stale) <= {p.name for p in (ROOT / "bench").glob("results-*.json")}


def test_the_stale_results_files_rerun_in_one_command_from_bench_readme():
    """`tokenloop-bench record NAME...` runs each benchmark as recorded (its `record` arguments) into its results
    file; bench/README.md gives the command for every file that awaits a rerun."""
    assert ".venv/bin/" + RERUN in " ".join((ROOT / "bench" / "README.md").read_text().split())
    for name in AWAITING_RERUN:
        args = BENCHMARKS[name].arguments("record")
        assert args[-2:] == ["--out", f"bench/{BENCHMARKS[name].results}"], name
    assert BENCHMARKS["engine_gil"].arguments("record")[:2] == ["--streams", "16"]  # one run per file


@pytest.mark.parametrize("argv", [["record"], ["record", "bandwidth"], ["record", "nonesuch"]])
def test_record_needs_benchmarks_that_record(argv, capsys):
    """`record` alone, or naming a benchmark without a results file (or none such), runs nothing and says why."""
    from tokenloop.bench.__main__ import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("none named" in err) if argv == ["record"] else (argv[1] in err)


def test_the_overhead_table_reads_the_one_run_service_overhead_writes(tmp_path, monkeypatch):
    """results-overhead.json is one run (what `service_overhead --out` writes, stamped), so a rerun replaces it and
    the `overhead` table follows (`tokenloop-bench figures --write`)."""
    from tokenloop.bench import figures, harness
    monkeypatch.setattr(harness, "COMMAND", ["tokenloop-bench", "service_overhead", "--out", "x.json"])
    rows = {"bare": [{"streams": 64, "messages_per_s": 900.0}, {"streams": 256, "messages_per_s": 1000.0}],
            "messages": [{"streams": 64, "tokens_per_s": 810.0}, {"streams": 256, "tokens_per_s": 955.0}]}
    write(str(tmp_path / "results-overhead.json"), rows)
    monkeypatch.setattr(figures, "BENCH", tmp_path)
    figures.load.cache_clear()
    try:
        table = figures.render("overhead")  # 955 / 1000 at 256: tokens over bare messages
        assert "`tokenloop-bench service_overhead --out x.json`" in table and f"`{harness.commit()}`" in table
        assert table.splitlines()[-2:] == ["| 64 | 810 | 900 | 0.90x |", "| 256 | 955 | 1,000 | 0.95x |"]
    finally:
        figures.load.cache_clear()
