"""One summary file for a table of docs/benchmarks.md, from the raw result files of its run.

The run scripts under bench/ write their raw output (per-run result JSON, server logs,
`/admin/stats` dumps) under results/, which git ignores. What the repository keeps of a
run is one summary per table: this script folds the run's JSON files into one file, each
under its file name, with what only a log needs taken out:

  * a `tools.bench.bench_serving` result keeps its settings and metrics and drops its
    per-request lists (prompt and output lengths, TTFTs, end-to-end times, finish
    reasons, errors); a workload's `cached_tokens`, `groups` and `turns` stay, since
    tables quote them;
  * an `/admin/stats` dump keeps every counter and drops `recent` (the last requests);
  * any other JSON (compare_logits --json, bench_speculative, bench_burst, ...) is kept
    whole: those are already summaries.

    python bench/summarize.py --out bench/quant/sbs/summary.json results/quant/sbs/*.json

The markdown tables of the side-by-side runs come from their own summarizers
(bench/quant/gguf/summarize.py, bench/quant/blocks/summarize.py), whose output is kept
as the table's summary instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# A bench_serving result's per-request lists: what a log holds, not a table.
PER_REQUEST = ("input_lens", "requested_output_lens", "output_lens", "output_tokens_from", "ttfts_ms",
               "e2els_ms", "finish_reasons", "request_errors")


def compact(data):
    """A raw result file's content with its per-request detail taken out (see the docstring)."""
    if isinstance(data, dict) and "ttfts_ms" in data and "output_throughput" in data:
        return {k: v for k, v in data.items() if k not in PER_REQUEST}
    if isinstance(data, dict) and "kv_blocks_total" in data and "recent" in data:
        return {k: v for k, v in data.items() if k != "recent"}
    return data


def summarize(paths: list[Path], command: str) -> dict:
    names = [p.name for p in paths]
    if len(set(names)) != len(names):
        raise SystemExit(f"two result files share a name: {sorted(names)}")
    return {"made_by": command, "files": {p.name: compact(json.loads(p.read_text())) for p in sorted(paths)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/summarize.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="the summary file to write (.json)")
    p.add_argument("--made-by", default=None, help="the command recorded in the summary (default: this one)")
    p.add_argument("files", nargs="+", type=Path, help="the run's raw JSON result files")
    args = p.parse_args(argv)
    command = args.made_by or " ".join(["python bench/summarize.py", "--out", str(args.out),
                                        *(str(f) for f in args.files)])
    args.out.write_text(json.dumps(summarize(args.files, command), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
