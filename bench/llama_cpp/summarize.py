"""The table of a side-by-side run (bench/llama_cpp/side_by_side.sh): per concurrency, each
server's median over rounds of output tok/s, TTFT p50 and TPOT p50, the ratio ferrox / llama-server,
the peak RSS of each, and the start-up times. A before / after run (bench/llama_cpp/before_after.sh)
adds "ferrox-before" and the ratio ferrox / ferrox-before.

    .venv/bin/python bench/llama_cpp/summarize.py results/sbs-1b-q4km [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def _runs(folder: Path) -> dict[tuple[str, int], list[dict]]:
    runs: dict[tuple[str, int], list[dict]] = {}
    for f in sorted(folder.glob("*-c*-r*.json")):
        m = re.match(r"(.+)-c(\d+)-r(\d+)\.json$", f.name)
        if m:
            runs.setdefault((m.group(1), int(m.group(2))), []).append(json.loads(f.read_text()))
    return runs


def summarize(folder: Path) -> dict:
    runs = _runs(folder)
    rows = []
    for conc in sorted({c for _, c in runs}):
        row = {"concurrency": conc}
        for server in ("llama-server", "ferrox", "ferrox-before"):
            results = runs.get((server, conc), [])
            if not results:
                continue
            row[server] = {
                "rounds": len(results),
                "output_tok_s": statistics.median(r["output_throughput"] for r in results),
                "ttft_p50_ms": statistics.median(r["median_ttft_ms"] for r in results),
                "tpot_p50_ms": statistics.median(r["median_tpot_ms"] for r in results),
                "failed": sum(r.get("num_failed", 0) for r in results),
                "len_mismatch": sum(r.get("num_output_len_mismatch", 0) for r in results),
                "per_round_tok_s": [round(r["output_throughput"], 2) for r in results],
            }
        if "llama-server" in row and "ferrox" in row:
            row["ratio"] = row["ferrox"]["output_tok_s"] / row["llama-server"]["output_tok_s"]
        if "ferrox-before" in row and "ferrox" in row:
            row["after_before"] = row["ferrox"]["output_tok_s"] / row["ferrox-before"]["output_tok_s"]
        rows.append(row)
    out = {"rows": rows}
    rss = folder / "rss.jsonl"
    if rss.exists():
        lines = [json.loads(x) for x in rss.read_text().splitlines() if x.strip()]
        out["peak_rss_gib"] = {k.removesuffix("_kib"): max(x[k] for x in lines) / 2**20
                               for k in ("llama-server_kib", "ferrox_kib", "ferrox-before_kib") if k in lines[0]}
    if (folder / "startup.json").exists():
        out.update(json.loads((folder / "startup.json").read_text()))
    return out


def table(summary: dict) -> str:
    lines = ["| conc | llama-server tok/s | ferrox tok/s | ratio | TTFT p50 ms (peer / ours) | TPOT p50 ms (peer / ours) |",
             "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        p, o = r.get("llama-server", {}), r.get("ferrox", {})
        lines.append(f"| {r['concurrency']} | {p.get('output_tok_s', 0):.1f} | {o.get('output_tok_s', 0):.1f} | "
                     f"{r.get('ratio', 0):.2f}x | {p.get('ttft_p50_ms', 0):.0f} / {o.get('ttft_p50_ms', 0):.0f} | "
                     f"{p.get('tpot_p50_ms', 0):.1f} / {o.get('tpot_p50_ms', 0):.1f} |")
    for r in summary["rows"]:
        if "after_before" in r:
            b = r["ferrox-before"]
            lines.append(f"c{r['concurrency']} ferrox before: {b['output_tok_s']:.1f} tok/s, TTFT {b['ttft_p50_ms']:.0f}, "
                         f"TPOT {b['tpot_p50_ms']:.1f}; after / before {r['after_before']:.2f}x")
    if "peak_rss_gib" in summary:
        lines.append("\npeak RSS: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in summary["peak_rss_gib"].items()))
    if "startup_s" in summary:
        s = summary["startup_s"]
        lines.append(f"start-up to /health: llama-server {s['llama-server']:.1f} s, ferrox {s['ferrox']:.1f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    summary = summarize(args.folder)
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
