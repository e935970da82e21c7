"""Bench output: the summary table and the throughput / latency plot (matplotlib, optional)."""

from __future__ import annotations

_COLUMNS = (
    ("conc", lambda r: f"{r['concurrency']}"),
    ("reqs", lambda r: f"{r['num_requests']}"),
    ("errs", lambda r: f"{r['num_errors']}"),
    ("req/s", lambda r: f"{r['requests_per_s']:.2f}"),
    ("out tok/s", lambda r: f"{r['output_tokens_per_s']:.1f}"),
    ("TTFT p50", lambda r: _ms(r["ttft_s"]["p50"])),
    ("TTFT p95", lambda r: _ms(r["ttft_s"]["p95"])),
    ("TTFT p99", lambda r: _ms(r["ttft_s"]["p99"])),
    ("ITL p50", lambda r: _ms(r["itl_s"]["p50"])),
    ("ITL p95", lambda r: _ms(r["itl_s"]["p95"])),
    ("ITL p99", lambda r: _ms(r["itl_s"]["p99"])),
    ("e2e p50", lambda r: _ms(r["latency_s"]["p50"])),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def table(results: list[dict]) -> str:
    """A Markdown table, one row per load level, then the errors by status code."""
    header = [name for name, _ in _COLUMNS]
    rows = [[cell(r) for _, cell in _COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    out += [line(row) for row in rows]
    for r in results:
        if r["errors_by_code"]:
            codes = ", ".join(f"{code} x{n}" for code, n in sorted(r["errors_by_code"].items()))
            out.append(f"errors at concurrency {r['concurrency']}: {codes}")
    return "\n".join(out)


def plot(results: list[dict], path: str, title: str = "") -> None:
    """Draw throughput and TTFT / ITL percentiles against concurrency into path (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit("--plot needs matplotlib: pip install 'tokenloop-client[plot]'") from err
    conc = [r["concurrency"] for r in results]
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_tp.plot(conc, [r["output_tokens_per_s"] for r in results], marker="o", label="output tok/s")
    ax_tp.set_xlabel("concurrent streams")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput")
    ax_tp.set_ylim(bottom=0)
    for key, label, color in (("ttft_s", "TTFT", "tab:blue"), ("itl_s", "ITL", "tab:red")):
        for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            values = [_none_to_nan(r[key][q]) * 1000 for r in results]
            ax_lat.plot(conc, values, style, color=color, marker="o", label=f"{label} {q}")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("concurrent streams")
    ax_lat.set_ylabel("milliseconds (log)")
    ax_lat.set_title("latency")
    ax_lat.legend(fontsize=8)
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _none_to_nan(value: float | None) -> float:
    return float("nan") if value is None else value
