"""Plot several `tools.bench.bench_serving --result-json` files side by side.

    python -m tools.bench.plot_bench results/*.json --output docs/bench_serving.png

One PNG, two panels against the concurrency cap (`max_concurrency`, log2 axis): output
token throughput and median TTFT, one line per `label` (one line per server). Files run
without a concurrency cap (rate-only runs) have no x value here and are skipped with a
note on stderr. The same results are printed as the markdown table of docs/benchmarks.md,
so the numbers there are pasted, not retyped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Sequence

# (result field, y label, title, y scale): TTFT spans ms at low load to tens of seconds
# for a server that queues, so its axis is logarithmic.
PANELS = (("output_throughput", "output tokens/s", "Output token throughput", "linear"),
          ("median_ttft_ms", "TTFT p50 (ms, log)", "Time to first token, median", "log"))


def load_series(paths: Sequence[str]) -> dict[str, list[dict]]:
    """label -> results sorted by max_concurrency (rate-only results skipped)."""
    series: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        result = json.loads(Path(path).read_text())
        if result.get("max_concurrency") is None:
            print(f"plot_bench: {path} has no max_concurrency; skipped", file=sys.stderr)
            continue
        series[result["label"]].append(result)
    return {label: sorted(rs, key=lambda r: r["max_concurrency"]) for label, rs in sorted(series.items())}


TABLE_HEADER = ("| server | concurrency | requests ok / failed | output tok/s | total tok/s | TTFT p50 (ms) "
                "| TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | e2el p50 (s) | len mismatches |")


def markdown_table(paths: Sequence[str]) -> str:
    """docs/benchmarks.md's results table, one row per result file (by label, concurrency)."""
    def num(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if v is None else f"{v * scale:.{digits}f}"

    rows = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for label, results in load_series(paths).items():
        for r in results:
            rows.append(f"| {label} | {r['max_concurrency']} | {r['completed']} / {r['num_failed']} "
                        f"| {num(r['output_throughput'])} | {num(r['total_token_throughput'])} "
                        f"| {num(r['median_ttft_ms'], digits=0)} | {num(r['p99_ttft_ms'], digits=0)} "
                        f"| {num(r['median_tpot_ms'])} | {num(r['median_itl_ms'])} "
                        f"| {num(r['median_e2el_ms'], 1e-3, 2)} | {r['num_output_len_mismatch']} |")
    return "\n".join(rows)


def plot(paths: Sequence[str], output: str, title: str | None = None) -> Path:
    """Write the two-panel PNG for the result files in `paths`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    series = load_series(paths)
    if not series:
        raise ValueError("no result file with a max_concurrency to plot")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2))
    for ax, (field, ylabel, panel_title, yscale) in zip(axes, PANELS):
        for label, results in series.items():
            xs = [r["max_concurrency"] for r in results]
            ys = [r[field] if r[field] is not None else float("nan") for r in results]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        if yscale == "linear":
            ax.set_ylim(bottom=0)
        concurrencies = sorted({r["max_concurrency"] for rs in series.values() for r in rs})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    first = next(iter(series.values()))[0]
    fig.suptitle(title or f"{first.get('input_len')}-token prompts, {first.get('output_len')} output tokens")
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.plot_bench", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="result JSON files from tools.bench.bench_serving")
    p.add_argument("--output", "-o", default="bench_serving.png")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    print(markdown_table(a.results))
    print(plot(a.results, a.output, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
