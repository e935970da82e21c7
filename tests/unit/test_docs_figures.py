"""The docs check's figures (tests/docs_check.py `figure_problems`, bench/figures.py): every figure the README and
docs/ quote agrees with its results file, the README's Measured table is what results-engine.json renders, and a
measured number in the README's Measured and Features sections is tied to a results file or marked as history."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import ROOT
from tests.docs_check import figure_problems
from tokenloop.bench import figures


def test_every_figure_in_the_readme_and_docs_agrees_with_its_results_file():
    assert figure_problems() == []


def test_every_figure_name_computes_from_its_results_file():
    for name, figure in figures.FIGURES.items():
        assert (ROOT / "bench" / figure.results).is_file(), name
        assert figures.value(name), name


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A scratch repository: the README with a figure line and the engine table, and a results file to edit."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "bench" / "results-engine.json", tmp_path / "bench" / "results-engine.json")
    monkeypatch.setattr(figures, "BENCH", tmp_path / "bench")
    figures.load.cache_clear()
    yield tmp_path
    figures.load.cache_clear()


def _readme(repo, body: str) -> list[str]:
    (repo / "README.md").write_text(f"# x\n\n## Measured\n\n{body}\n\n## Features\n\n- nothing measured\n")
    return figures.problems(repo / "README.md", repo)


def _int8_vs_fp32(data: dict) -> float:
    rate = {r["system"]: r["tokens_per_s"] for r in data["results"] if r["scenario"] == "single"}
    return rate["tokenloop int8"] / rate["tokenloop fp32"]


def test_a_figure_that_disagrees_with_its_results_file_fails(repo):
    now = f"{_int8_vs_fp32(json.loads((repo / 'bench' / 'results-engine.json').read_text())):.2f}x"
    assert _readme(repo, f"int8 at {now}<!-- figure engine.int8_vs_fp32_single --> fp32") == []
    bad = _readme(repo, "int8 at **0.7x**<!-- figure engine.int8_vs_fp32_single --> fp32")
    assert bad == [f"README.md:5: the text says '0.7x' where bench/results-engine.json gives '{now}' "
                   "(figure engine.int8_vs_fp32_single)"]
    assert "no figure 'engine.nonesuch'" in _readme(repo, "1.0x<!-- figure engine.nonesuch -->")[0]


def test_a_rerun_that_changes_the_results_file_fails_the_old_text(repo):
    data = json.loads((repo / "bench" / "results-engine.json").read_text())
    text = f"int8 at {_int8_vs_fp32(data):.2f}x<!-- figure engine.int8_vs_fp32_single --> fp32"
    for r in data["results"]:
        if r["system"] == "tokenloop int8" and r["scenario"] == "single":
            r["tokens_per_s"] *= 1.1
    (repo / "bench" / "results-engine.json").write_text(json.dumps(data))
    figures.load.cache_clear()
    assert f"gives '{_int8_vs_fp32(data):.2f}x'" in _readme(repo, text)[0]


def test_the_rendered_table_must_be_current(repo):
    table = figures.render("engine")
    data = json.loads((repo / "bench" / "results-engine.json").read_text())
    single = {r["system"]: r for r in data["results"] if r["scenario"] == "single"}
    row = " | ".join(f"{single[s]['tokens_per_s']:.1f}, {single[s]['ttft_p50_s']:.2f} s"
                     for s in ("transformers", "llama-server Q4_1", "tokenloop fp32"))
    assert f"| single: 1 request, 128 new tokens | {row} |" in table
    assert "tokenloop int4 the median of 5" in table
    assert _readme(repo, f"<!-- figures table engine -->\n{table}\n<!-- figures end -->") == []
    int4 = f"{single['tokenloop int4']['tokens_per_s']:.1f}, "
    stale = table.replace(int4, "1.0, ")
    assert "the engine table is not what bench/results-engine.json renders" in \
        _readme(repo, f"<!-- figures table engine -->\n{stale}\n<!-- figures end -->")[0]
    assert figures.write_tables(repo / "README.md") and figures.problems(repo / "README.md", repo) == []


def test_a_measured_number_needs_a_figure_or_a_history_marker(repo):
    assert _readme(repo, "it ran at 1.9x the old one") == [
        "README.md:5: '1.9x' states a measurement with no <!-- figure NAME --> after it and no "
        "<!-- history DATE COMMIT --> in its paragraph, list item or table"]
    assert _readme(repo, "<!-- history 2026-12-02 8a585e2 -->\nit ran at 1.9x the old one, and 72 % of it") == []
    assert _readme(repo, "a 64-token prompt, 128 new tokens, 2-vCPU, AVX-512, 4-bit, 1e-4") == []  # no unit: not one
    assert "a history marker is" in _readme(repo, "<!-- history 2026-12 8a585e2 -->\n1.9x")[0]


def test_a_history_marker_names_a_commit_of_this_repository(repo):
    if figures.git_has("HEAD") is None:
        pytest.skip("git cannot tell here (no git, or a shallow clone)")
    assert "history commit 0000000 is not in this repository" in _readme(repo, "<!-- history 2026-12-02 0000000 -->")[0]


def test_a_measured_paragraph_or_section_in_the_docs_needs_its_provenance(repo):
    doc = repo / "docs" / "x.md"
    doc.write_text("# x\n\n**Measured** 2026-12-06: 1.4x faster.\n\nA default of 30 s is not a measurement.\n\n"
                   "## Measured\n\n- a bullet: 2.0x\n")
    assert [p.split(" states")[0] for p in figures.problems(doc, repo)] == ["docs/x.md:3: '1.4x'", "docs/x.md:9: '2.0x'"]
    doc.write_text("# x\n\n<!-- history 2026-12-06 8a585e2 -->\n**Measured** 2026-12-06: 1.4x faster.\n\n"
                   "## Measured\n\n- <!-- history 2026-12-06 8a585e2 -->a bullet: 2.0x\n")
    assert figures.problems(doc, repo) == []


def test_a_measured_number_anywhere_in_the_docs_needs_its_provenance(repo):
    """Outside the Measured sections too: a ratio or a rate anywhere, a number with a unit in a block that says it
    measured; a setting, a literal in `code` and a product (`6 x 32`) are not figures."""
    doc = repo / "docs" / "x.md"
    cases = {
        "The new path runs 2.5x the old one.": ["'2.5x'"],
        "It streams 180 tok/s on one core.": ["'180 tok/s'"],
        "- a decode step took 12 ms here, 3 % of it in attention": ["'12 ms'", "'3 %'"],
        "| case | p99 |\n| --- | --- |\n| one stream | 4.2 ms |": ["'4.2 ms'"],
        "`--stall-timeout` defaults to 60 s; pings every 10 s.": [],
        "An example refusal: `the mask took 303 ms of CPU (the limit is 50 ms)`.": [],
        "``a `regex` took 303 ms``": [],
        "Tiles of 6 x 32 floats, on TensorRT-LLM `0.1x`.": [],
        "<!-- history 2026-12-06 8a585e2 -->\nThe new path runs 2.5x the old one; a step took 12 ms.": [],
        "- <!-- history 2026-12-06 8a585e2 -->a decode step took 12 ms here": [],
        "```text\nit took 12 ms\n```": [],
    }
    for text, flagged in cases.items():
        doc.write_text(f"# x\n\n{text}\n")
        got = [p.split(": ", 1)[1].split(" states")[0] for p in figures.problems(doc, repo)]
        assert got == flagged, (text, got)
