"""bench/summarize.py: a run's raw result files folded into the one summary the repository
keeps per table of docs/benchmarks.md, without the per-request detail only a log needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_run_is_folded_into_one_summary_without_per_request_detail(tmp_path):
    serving = {"label": "ferrox", "max_concurrency": 8, "output_throughput": 112.7, "median_ttft_ms": 514.2,
               "ttfts_ms": [1.0, 2.0], "e2els_ms": [3.0, 4.0], "input_lens": [128, 128], "output_lens": [128, 128],
               "requested_output_lens": [128, 128], "output_tokens_from": ["usage"] * 2,
               "finish_reasons": ["length"] * 2, "request_errors": [None, None], "cached_tokens": [0, 304]}
    stats = {"kv_blocks_total": 5824, "kv_blocks_free": 5824, "recompiles_after_warmup": 0,
             "recent": [{"id": "cmpl-1", "status": 200}]}
    other = {"summary": [{"workload": "copy", "speedup": 1.4}]}
    files = {"ferrox-c8.json": serving, "ferrox-admin-stats.json": stats, "speculative.json": other}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "bench/summarize.py", "--out", str(out), *(str(tmp_path / n) for n in files)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["made_by"].startswith("python bench/summarize.py --out")
    kept = summary["files"]
    assert sorted(kept) == sorted(files)
    assert kept["ferrox-c8.json"] == {"label": "ferrox", "max_concurrency": 8, "output_throughput": 112.7,
                                      "median_ttft_ms": 514.2, "cached_tokens": [0, 304]}, \
        "metrics and settings stay, per-request lists go (cached tokens stay: tables quote them)"
    assert kept["ferrox-admin-stats.json"] == {k: v for k, v in stats.items() if k != "recent"}
    assert kept["speculative.json"] == other, "a result that is already a summary is kept whole"
