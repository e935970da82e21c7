"""The figures the README and docs quote, computed from the results files, and the check that the text agrees.

In Markdown (README.md, docs/*.md):

- `<!-- figure NAME -->` right after a number: the text just before the marker must end with FIGURES[NAME] as
  computed from its results file (bold and spaces aside);
- `<!-- figures table NAME -->` ... `<!-- figures end -->`: the lines between are TABLES[NAME], rendered from its
  results file (`tokenloop-bench figures --write` rewrites them);
- `<!-- history DATE COMMIT -->`: the paragraph or list item it opens (or ends) quotes figures that no results file
  holds any more, measured on DATE and recorded by COMMIT.

Every number with a unit of measure (x, %, s, ms, µs, tok/s, GB/s) that states a measurement must be one of the
first or inside the last two (`unmarked`): a ratio or a rate anywhere, any such number in a paragraph, list item or
table that says it measured (took, ran, median, p99, faster, a machine: MEASURING), and every one in the README's
Measured and Features sections, a `## Measured` section or a paragraph that opens with "Measured". A number in
`code` is a literal (a default, a log line, an error message), not a figure. `problems()` is what
tests/docs_check.py runs.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenloop.bench.harness import ROOT, describe

BENCH = ROOT / "bench"
FIGURE = re.compile(r"<!-- figure (\S+) -->")
TABLE = re.compile(r"^<!-- figures table (\S+) -->$")
TABLE_END = "<!-- figures end -->"
HISTORY = re.compile(r"<!-- history (\S+) (\S+) -->")
# a number with a unit of measure: 3.14x, 72 %, 0.23 s, 1.5 ms, 211.6 tok/s, 32.7 GB/s, 0.76-0.95x
MEASURE = re.compile(r"(?<![\w.+-])[~+]?\d[\d,]*(?:\.\d+)?(?:[–-]\d[\d,]*(?:\.\d+)?)?(?:x|\s?(?:%|ms|µs|s|tok/s|GB/s))"
                     r"(?![\w/])")  # a ratio's x is attached (`6 x 32` is a product)
CHECKED_SECTIONS = {"README.md": ("## Measured", "## Features")}  # where every measured number must be tied
MEASURED = re.compile(r"^(- )?(\*\*)?Measured\b")  # a paragraph that opens so states measurements


@functools.cache
def load(name: str) -> dict | list:
    return json.loads((BENCH / name).read_text())


# --- results-engine.json ---

def _result(data: dict, system: str, scenario: str) -> dict:
    for r in data["results"]:
        if r["system"] == system and r["scenario"] == scenario:
            return r
    raise KeyError(f"results-engine.json has no {system} on {scenario}")


def _decode_median(r: dict) -> float:
    """The median over the repeats of the rate after the first token (not the repeat that is median by tok/s)."""
    rates = [rep[1] for rep in r.get("repeats") or [] if rep[1] is not None]
    if rates:
        return statistics.median(rates)
    return (r["num_tokens"] - 1) / (r["wall_s"] - r["ttft_s"][0])


def _share(data: dict, mode: str, rate: float) -> str:
    bw = data["bandwidth"]
    return f"{100 * bw['weight_bytes_per_token'][mode] * rate / bw['limit_bytes_per_s']:.0f} %"


def _ratio(data: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    return f"{_result(data, *a)['tokens_per_s'] / _result(data, *b)['tokens_per_s']:.2f}x"


def _when(data: dict) -> str:
    return data["date"].replace("T", " ").removesuffix("Z")[:16] + " UTC"


LLAMA = "llama-server Q4_1"
SYSTEMS = ("transformers", LLAMA, "tokenloop fp32", "tokenloop int8", "tokenloop int4")
SCENARIOS = {"single": "single: 1 request, 128 new tokens", "eight": "eight: 8 requests, 64-token prompts, 128 new",
             "uniform": "uniform: 32 requests, 64-token prompts, 128 new",
             "mixed": "mixed: 64 requests, ≤ 32 in flight, 16–512 / 16–256 tokens"}


def engine_table(data: dict) -> str:
    """The README's Measured table: tok/s and TTFT p50 of each system on each scenario, with the run's date, CPU,
    commit and command above it, and how the one-stream figures were taken."""
    have = {(r["system"], r["scenario"]) for r in data["results"]}
    repeats = {s: len(_result(data, s, "single").get("repeats") or []) or 1 for s in SYSTEMS if (s, "single") in have}
    intro = (f"One run, {_when(data)}, every row on the same {data['cpus']}-vCPU {describe(data)}, code at "
             f"`{data.get('commit', 'not recorded')}`: `{data.get('command', 'not recorded')}`. One stream: "
             + "; ".join(f"{s} the median of {n}" if n > 1 else f"{s} one run, no warm-up" for s, n in repeats.items())
             + ". Compare ratios within one run only.")
    lines = [textwrap.fill(intro, 118, break_on_hyphens=False, break_long_words=False), "",
             "| scenario (tok/s, TTFT p50) | transformers | llama-server | tokenloop fp32 | `--weights int8` | "
             "`--weights int4` |", "| --- | --- | --- | --- | --- | --- |"]
    for scenario, label in SCENARIOS.items():
        cells = []
        for system in SYSTEMS:
            if (system, scenario) not in have:
                cells.append("(slots too small)" if system == LLAMA else "—")
                continue
            r = _result(data, system, scenario)
            cells.append(f"{r['tokens_per_s']:.1f}, {r['ttft_p50_s']:.2f} s")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- results-overhead.json: one run of `tokenloop-bench service_overhead` ---

def _over_bare(d: dict, streams: int, scenario: str = "messages") -> float:
    """A scenario's tokens/s (by default the full path's, one token per message) over a bare grpc.aio method's
    messages/s at `streams`."""
    row = next(r for r in d[scenario] if r["streams"] == streams)
    return row["tokens_per_s"] / next(r for r in d["bare"] if r["streams"] == streams)["messages_per_s"]


def overhead_table(d: dict) -> str:
    """The front against bare grpc.aio: the run's date, CPU, commit and command, then the ratio at each concurrency."""
    intro = (f"One run, {_when(d)}, on a {d['cpus']}-vCPU {describe(d)}, code at `{d['commit']}`: `{d['command']}`. "
             "Each row the best of its interleaved repeats; compare ratios within one run only.")
    lines = [textwrap.fill(intro, 118, break_on_hyphens=False, break_long_words=False), "",
             "| streams | full path tok/s (one token per message) | bare grpc.aio msgs/s | full ÷ bare |",
             "| --- | --- | --- | --- |"]
    bare = {r["streams"]: r for r in d["bare"]}
    for r in d["messages"]:
        if r["streams"] in bare:
            lines.append(f"| {r['streams']} | {r['tokens_per_s']:,.0f} | {bare[r['streams']]['messages_per_s']:,.0f} "
                         f"| {_over_bare(d, r['streams']):.2f}x |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Figure:
    """A figure the docs quote: its results file and how it is computed from it (as the text writes it)."""

    results: str
    compute: Callable[[dict], str]


E = "results-engine.json"
FIGURES = {
    "engine.int8_vs_fp32_single": Figure(E, lambda d: _ratio(d, ("tokenloop int8", "single"),
                                                             ("tokenloop fp32", "single"))),
    **{f"engine.int4_vs_llama_{s}": Figure(E, lambda d, s=s: _ratio(d, ("tokenloop int4", s), (LLAMA, s)))
       for s in ("single", "eight", "uniform")},
    **{f"engine.int8_vs_llama_{s}": Figure(E, lambda d, s=s: _ratio(d, ("tokenloop int8", s), (LLAMA, s)))
       for s in ("single", "eight", "uniform")},
    **{f"engine.fp32_vs_transformers_{s}": Figure(E, lambda d, s=s: _ratio(d, ("tokenloop fp32", s),
                                                                            ("transformers", s)))
       for s in ("uniform", "mixed")},
    "engine.int4_decode_share": Figure(E, lambda d: _share(d, "int4", _decode_median(
        _result(d, "tokenloop int4", "single")))),
    "engine.int4_request_share": Figure(E, lambda d: _share(d, "int4", _result(d, "tokenloop int4", "single")
                                                            ["tokens_per_s"])),
    "engine.bandwidth_limit": Figure(E, lambda d: f"{d['bandwidth']['limit_bytes_per_s'] / 1e9:.1f} GB/s"),
    "engine.int4_bytes_vs_int8": Figure(E, lambda d: f"{d['bandwidth']['weight_bytes_per_token']['int4'] / d['bandwidth']['weight_bytes_per_token']['int8']:.2f}x"),  # noqa: E501
    **{f"engine.weight_mb_{m}": Figure(E, lambda d, m=m: f"{d['bandwidth']['weight_bytes_per_token'][m] / 1e6:.1f} MB")
       for m in ("fp32", "int8", "int4")},
}
S = "results-structured.json"
FIGURES |= {
    "structured.ratio": Figure(S, lambda d: f"{d['throughput']['ratio']:.2f}x"),
    "structured.constrained_tok_s": Figure(S, lambda d: f"{d['throughput']['constrained_tok_s']:.1f}"),
    "structured.free_tok_s": Figure(S, lambda d: f"{d['throughput']['free_tok_s']:.1f}"),
    "structured.schema_compile_p50": Figure(S, lambda d: f"{d['compile']['schema_p50_s'] * 1e3:.2f} ms"),
    "structured.schema_compile_max": Figure(S, lambda d: f"{d['compile']['schema_max_s'] * 1e3:.2f} ms"),
    "structured.admission_p50": Figure(S, lambda d: f"{d['admission']['p50_s'] * 1e6:.1f} µs"),
    "structured.admission_p99": Figure(S, lambda d: f"{d['admission']['p99_s'] * 1e6:.1f} µs"),
}
SP = "results-spec.json"
SPEC_OURS = ("tokenloop off", "tokenloop ngram")


def _spec_row(d: dict, scenario: str, streams: int) -> dict:
    for row in d["rows"]:
        if row["scenario"] == scenario and row["streams"] == streams:
            return row
    raise KeyError(f"results-spec.json has no {scenario} row at {streams} streams")


def _llama_best(row: dict) -> tuple[str, float]:
    """llama-server's fastest arm on a row (plain or one of its n-gram speculation types)."""
    arms = {k: v["tok_s"] for k, v in row.items() if k.startswith("llama-server")}
    best = max(arms, key=arms.get)
    return best, arms[best]


def spec_table(d: dict) -> str:
    """Speculative decoding off / ngram against llama-server plain and with its n-gram speculation (tok/s)."""
    runs = "; ".join(f"{r['date'].replace('T', ' ')[:16]} UTC at `{r['commit']}`: `{r['command']}`" for r in d["runs"])
    intro = (f"Greedy, {d['new_tokens']} new tokens per request, EOS ignored, `--weights {d['weights']}`, the median of "
             f"each row's interleaved rounds, on a {d['cpus']}-vCPU {describe(d)}; {runs}.")
    lines = [textwrap.fill(intro, 118, break_on_hyphens=False, break_long_words=False), "",
             "| scenario | streams | speculation off | `--speculative ngram` (tokens per verification) | "
             "llama-server, best of plain / ngram-simple / ngram-map-k | ngram / off | ngram / llama-server |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in d["rows"]:
        off, on = row["tokenloop off"]["tok_s"], row["tokenloop ngram"]
        per_step = f" ({on['tokens_per_step']:.2f})" if on.get("tokens_per_step") else ""
        llama = _llama_best(row) if any(k.startswith("llama-server") for k in row) else None
        lines.append(f"| {row['scenario']} | {row['streams']} | {off:.1f} | {on['tok_s']:.1f}{per_step} | "
                     + (f"{llama[1]:.1f} ({llama[0].removeprefix('llama-server').strip() or 'plain'})" if llama
                        else "—")
                     + f" | {on['tok_s'] / off:.2f}x | " + (f"{on['tok_s'] / llama[1]:.2f}x |" if llama else "— |"))
    return "\n".join(lines)


def _spec_ratio(d: dict, scenario: str, streams: int, versus: str = "off") -> str:
    row = _spec_row(d, scenario, streams)
    other = row["tokenloop off"]["tok_s"] if versus == "off" else _llama_best(row)[1]
    return f"{row['tokenloop ngram']['tok_s'] / other:.2f}x"


FIGURES |= {
    **{f"spec.{sc}_{n}_vs_off": Figure(SP, lambda d, sc=sc, n=n: _spec_ratio(d, sc, n))
       for sc, n in (("grounded", 1), ("grounded", 8), ("chat", 1), ("chat", 8), ("chat", 32))},
    **{f"spec.{sc}_{n}_vs_llama": Figure(SP, lambda d, sc=sc, n=n: _spec_ratio(d, sc, n, "llama"))
       for sc, n in (("grounded", 1), ("grounded", 8))},
}
SZ = "results-size.json"


def _size_row(d: dict, model: str) -> dict:
    for row in d["rows"]:
        if row["model"] == model:
            return row
    raise KeyError(f"results-size.json has no {model} row")


def size_table(d: dict) -> str:
    """The size table: the fastest tokenloop mode against llama-server on the same files, 1 and 8 streams."""
    rerun = [row for row in d["rows"] if row.get("date") and row.get("commit") != d["commit"]]
    intro = (f"One run, {_when(d)}, every row{' but those noted below' if rerun else ''} on the same {d['cpus']}-vCPU "
             f"{describe(d)}, code at `{d['commit']}`: `{d['command']}`. 128 new tokens, EOS ignored; one stream the "
             f"median of {d['single_repeats']}.")
    lines = [textwrap.fill(intro, 118, break_on_hyphens=False, break_long_words=False), "",
             "| model | one stream: tokenloop / llama-server tok/s | ratio | eight streams: tokenloop / llama-server "
             "tok/s | ratio | int4 one stream: share of the bandwidth limit |", "| --- | --- | --- | --- | --- | --- |"]
    for row in d["rows"]:
        cells = []
        for scenario in ("single", "eight"):
            vs = row.get(scenario)
            cells += [f"{vs['tok_s']:.1f} ({vs['system'].removeprefix('tokenloop ')}) / {vs['llama_tok_s']:.1f}",
                      f"{vs['ratio']:.2f}x"] if vs else ["—", "—"]
        share = row.get("int4_decode_bandwidth_share")
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {f'{100 * share:.0f} %' if share else '—'} |")
    for row in rerun:  # a row measured again later (size_table --only) keeps its own date, commit and command
        note = (f"The {row['model']} row was measured again, {_when(row)}, same machine, code at `{row['commit']}`: "
                f"`{row['command']}`.")
        lines += ["", textwrap.fill(note, 118, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines)


FIGURES |= {
    **{f"size.{m}_{sc}": Figure(SZ, lambda d, m=m, sc=sc: f"{_size_row(d, m)[sc]['ratio']:.2f}x")
       for m in ("135M", "360M", "1.7B", "gemma3-270m") for sc in ("single", "eight")},
    "size.1.7B_int4_share": Figure(SZ, lambda d: f"{100 * _size_row(d, '1.7B')['int4_decode_bandwidth_share']:.0f} %"),
}
# --- results-front-ab.json: `tokenloop-bench service_overhead --ab-checkout DIR --streams 256` (issue 42 item 5) ---
AB = "results-front-ab.json"
FIGURES |= {f"front_ab.{arm}_256": Figure(AB, lambda d, arm=arm: f"{d['median_ratio_256'][arm]:.3f}x")
            for arm in ("A", "B")}
FIGURES |= {f"front_ab.{arm}_256_{q}": Figure(AB, lambda d, arm=arm, i=i: f"{d['quartiles_256'][arm][i]:.3f}x")
            for arm in ("A", "B") for i, q in ((0, "q1"), (2, "q3"))}
FIGURES |= {f"front_ab.{arm}_256_mean": Figure(AB, lambda d, arm=arm: f"{d['mean_rate_ratio_256'][arm]:.3f}x")
            for arm in ("A", "B")}
# --- results-overhead.json: the front's scenarios against bare grpc.aio at 256 streams ---
OV = "results-overhead.json"
FIGURES |= {f"overhead.{scenario}_256": Figure(OV, lambda d, sc=scenario: f"{_over_bare(d, 256, sc):.2f}x")
            for scenario in ("messages", "coalesced", "router")}
FIGURES |= {f"overhead.{scenario}_p50_256": Figure(
    OV, lambda d, sc=scenario: f"{next(r for r in d[sc] if r['streams'] == 256)['latency_p50_ms']:.2f} ms")
    for scenario in ("paced", "bare-paced")}


def model_load_table(d: dict) -> str:
    """Seconds to SERVING and resident memory per model (bench/model_load.py --serve)."""
    from tokenloop.bench.model_load import table

    intro = (f"One run, {_when(d)}, the {d['cpus']}-vCPU {describe(d)}, code at `{d['commit']}`: `{d['command']}` "
             "(after a first start of each model, which timed its routes; this start read them from the cache).")
    return textwrap.fill(intro, 118, break_on_hyphens=False, break_long_words=False) + "\n\n" + table(d["rows"])


TABLES = {"engine": (E, engine_table), "spec": (SP, spec_table), "size": (SZ, size_table),
          "overhead": ("results-overhead.json", overhead_table), "model-load": ("results-model-load.json",
                                                                              model_load_table)}


def value(name: str) -> str:
    figure = FIGURES[name]
    return figure.compute(load(figure.results))


def render(name: str) -> str:
    results, table = TABLES[name]
    return table(load(results))


# --- the check ---

def _plain(text: str) -> str:
    return text.replace("*", "").rstrip()


@functools.cache
def _commits() -> frozenset[str] | None:
    """Every commit of the repository (full hashes, read once); None where git cannot tell."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() == "true":
            return None
        listed = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        return frozenset(listed.stdout.split()) if listed.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_has(commit: str) -> bool | None:
    """Whether the repository holds `commit` (a hash or its prefix); None where git cannot tell (no git, a shallow
    clone)."""
    commits = _commits()
    return None if commits is None else any(full.startswith(commit) for full in commits)


def problems(path: Path, root: Path = ROOT) -> list[str]:
    """Where the figures of one Markdown file disagree with their results files, or break the rules above."""
    name, lines, out = path.relative_to(root), path.read_text().splitlines(), []
    table, start = None, 0
    for i, line in enumerate(lines, 1):
        if m := TABLE.match(line.strip()):
            if m.group(1) not in TABLES:
                out.append(f"{name}:{i}: no table {m.group(1)!r} (known: {', '.join(TABLES)})")
            table, start = m.group(1), i
            continue
        if line.strip() == TABLE_END and table:
            if table in TABLES and "\n".join(lines[start:i - 1]).strip() != render(table):
                out.append(f"{name}:{start}: the {table} table is not what bench/{TABLES[table][0]} renders: run "
                           "`.venv/bin/tokenloop-bench figures --write`")
            table = None
            continue
        for m in FIGURE.finditer(line):
            if m.group(1) not in FIGURES:
                out.append(f"{name}:{i}: no figure {m.group(1)!r} in bench/figures.py")
                continue
            want, before = value(m.group(1)), _plain(line[:m.start()])
            if not before.endswith(want):
                said = MEASURE.findall(before)
                out.append(f"{name}:{i}: the text says {said[-1] if said else before[-20:]!r} where "
                           f"bench/{FIGURES[m.group(1)].results} gives {want!r} (figure {m.group(1)})")
        for m in HISTORY.finditer(line):
            date, commit = m.groups()
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
                out.append(f"{name}:{i}: a history marker is <!-- history YYYY-MM-DD COMMIT -->; got {m.group(0)}")
            elif git_has(commit) is False:
                out.append(f"{name}:{i}: history commit {commit} is not in this repository")
    if table:
        out.append(f"{name}:{start}: the {table} table has no {TABLE_END}")
    return out + unmarked(path, root)


CODE_SPAN = re.compile(r"``.*?``|`[^`]*`")  # a literal (a log line, a flag's default, an error message): not a figure
# words that say a block reports a measurement: then each number with a unit in it is one
MEASURING = re.compile(r"\b(?:measured|measures|took|ran|runs? at|median|p50|p90|p99|faster|slower|speed-?up|"
                       r"costs?|reached|under load|at load|vCPU|VM|AVX|Xeon|EPYC)\b", re.IGNORECASE)
ALWAYS = re.compile(r"(?:x|tok/s|GB/s)$")  # a ratio or a rate is a measurement wherever it stands


def doc_blocks(lines: list[str]):
    """(first line number, lines) of each paragraph, list item or table of a Markdown file, outside fenced code;
    a heading is a block of its own. A blank line or a top-level `- ` item starts a new block."""
    block, start, fenced = [], 0, False
    for i, line in enumerate(lines, 1):
        text = line.strip()
        if text.startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or text.startswith(("```", "~~~")) or not text or line.startswith(("- ", "#")):
            if block:
                yield start, block
            block = []
            if fenced or not text or text.startswith(("```", "~~~")):
                continue
        if not block:
            start = i
        block.append(line)
        if line.startswith("#"):
            yield start, block
            block = []
    if block:
        yield start, block


def unmarked(path: Path, root: Path = ROOT) -> list[str]:
    """Numbers with a unit that state a measurement and are neither a marked figure, in a rendered table, nor
    history (a `<!-- history DATE COMMIT -->` in their paragraph, list item or table). A number states a measurement
    when it is a ratio or a rate (x, tok/s, GB/s), when its block says it measured (MEASURING: took, ran, median,
    p99, faster, a machine...), or wherever in CHECKED_SECTIONS, a `## Measured` section or a paragraph that opens
    with "Measured". A number inside `code` (a log line, a default, an error message) is a literal, not a figure."""
    name = str(path.relative_to(root))
    out, checked, in_table = [], False, False
    for start, block in doc_blocks(path.read_text().splitlines()):
        first = block[0].strip()
        if block[0].startswith("## "):
            checked = first in CHECKED_SECTIONS.get(name, ()) or first == "## Measured"
            continue
        opens = any(TABLE.match(line.strip()) for line in block)
        rendered, in_table = in_table or opens, (in_table or opens) and TABLE_END not in (b.strip() for b in block)
        if rendered or any(HISTORY.search(line) for line in block):
            continue
        plain = [CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) for line in block]
        measured = checked or bool(MEASURED.match(first.removeprefix("<!-- "))) or \
            any(MEASURING.search(line) for line in plain)
        for i, line in enumerate(plain, start):
            for m in MEASURE.finditer(line):
                if not (measured or ALWAYS.search(m.group(0))):
                    continue
                if not line[m.end():].lstrip("* ").startswith("<!-- figure "):
                    out.append(f"{name}:{i}: {m.group(0)!r} states a measurement with no <!-- figure NAME --> after "
                               "it and no <!-- history DATE COMMIT --> in its paragraph, list item or table")
    return out


def write_tables(path: Path) -> bool:
    """Rewrite the rendered tables of `path` in place; whether anything changed."""
    lines, out, skipping = path.read_text().splitlines(keepends=True), [], False
    for line in lines:
        m = TABLE.match(line.strip())
        if skipping and line.strip() == TABLE_END:
            skipping = False
        if not skipping:
            out.append(line)
        if m and m.group(1) in TABLES:
            out.append(render(m.group(1)) + "\n")
            skipping = True
    text = "".join(out)
    changed = text != path.read_text()
    path.write_text(text) if changed else None
    return changed


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    """`tokenloop-bench figures`: check every figure marker and table; `--write` rewrites the tables first."""
    argv = sys.argv[1:] if argv is None else argv
    if "--write" in argv:
        for path in doc_files():
            if write_tables(path):
                print(f"rewrote the tables of {path.relative_to(ROOT)}")
    bad = [p for path in doc_files() for p in problems(path)]
    print("\n".join(bad) or "every figure agrees with its results file")
    return 1 if bad else 0
