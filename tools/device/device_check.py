"""The accelerator check: one prepared script for a lent GPU (or TPU) machine, <= 8 minutes.

    python -m tools.device.device_check --out $OUT            # an H200: Llama-3.1-8B shape, bfloat16
    python -m tools.device.device_check --out /tmp/dc --small # anywhere: a tiny shape (tests run this)

Phases, in order, each in its own subprocess with its own time box (a phase that would
start with under 10 s left is skipped with a note; one that overruns is killed and keeps
what it had saved):

    phase      budget  what
    platform     30 s  versions, devices, measured copy bandwidth and bf16 matmul rate
    parity       90 s  pytest on DEVICE_TESTS (f32 and bf16 parity vs HF, GPU attention
                       candidates, the ragged kernel on a mixed step, dummy weights,
                       greedy batched == alone in bf16)
    attention    40 s  each decode-attention candidate, one layer, rows x contexts
    engine      135 s  the engine on a dummy Llama-3.1-8B: load, warm-up (compile) of exactly
                       the measured buckets, prefill 512 / 2,048, decode 1/8/64/256 rows at
                       contexts 512 / 2,048
    mixed        50 s  the unified step: 64 decode rows with 1 and 4 prompt chunks of 512 in one
                       forward, against the same work as separate forwards (the prefill
                       rate that --max-batched-tokens buys, and what it costs decoding rows),
                       with the engine's attention (auto: the ragged kernel)
    mixed_segments
                 40 s  the same through the attention auto took before the ragged kernels
                       (the loop, or the TPU decode kernel, one call per segment)
    torch        45 s  the same shapes through HF transformers on torch (the peer)
    rewarm       40 s  the engine loaded again in a fresh process: warm-up from the cache
                ----
                470 s  of the 480 s default --budget-s (each phase gets its share of
                       --budget-s among the phases selected with --phases)

The engine's compile dominates: buckets are only those measured (4 decode + 2 prefill),
and JAX's persistent compile cache lives in CACHE_DIR (under the system temp folder, not
under --out), so a second run on the same warm machine reads them back.

Writes under --out (three files, within the device tool's limits): `device_check.json`
(every phase's numbers), `device_check.md` (the tables, also printed last) and
`device_check.log` (every phase's output). Both are rewritten after each phase.
Rooflines: 4.8 TB/s of HBM and 790 TFLOP/s of bf16 (the H200 figures measured on this
workplace's machines, docs/gpu.md); the platform phase measures both again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.device.device_phases import PHASE_FUNCTIONS, PhaseResult, Settings
from tools.device.device_report import render_markdown

PHASES = ("platform", "parity", "attention", "engine", "mixed", "mixed_segments", "torch", "rewarm")
BUDGET_S = {"platform": 30, "parity": 90, "attention": 40, "engine": 135, "mixed": 50, "mixed_segments": 40,
            "torch": 45, "rewarm": 40}
DEFAULT_BUDGET_S = 480.0
SMALL_BUDGET_S = 900.0  # --small checks that every phase runs, not how fast: a loaded CI box is slow
MIN_PHASE_S = 10.0  # a phase is not started with less than this left
CACHE_DIR = os.path.join(tempfile.gettempdir(), "ferrox_device_check", "jax_cache")
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
BF16_FLOPS = 790e12  # H200, bf16 8192^3 matmul on random data, measured here (docs/gpu.md)
# The test files whose tests apply on an accelerator; none imports api/ (no Quart, Hypercorn
# or pydantic on the device machine).
DEVICE_TESTS = ("tests/models/test_parity_hf.py", "tests/models/test_bf16.py", "tests/models/test_gpu_attention.py",
                "tests/models/test_ragged_attention.py", "tests/models/test_dummy_weights.py",
                "tests/models/test_paged_attention.py")
REPO = Path(__file__).resolve().parents[2]

FULL = Settings(shape="llama-3.1-8b", dtype="bfloat16", rows=(1, 8, 64, 256), contexts=(512, 2048),
                prefill_tokens=(512, 2048), decode_steps=8, max_context=4096, block_size=16, attention_reps=20,
                copy_bytes=4 << 30, matmul_size=8192, cache_dir=CACHE_DIR)
SMALL = Settings(shape="tiny", dtype="float32", rows=(1, 4), contexts=(32, 64), prefill_tokens=(16, 32),
                 decode_steps=3, max_context=128, block_size=16, attention_reps=3, copy_bytes=8 << 20,
                 matmul_size=256, cache_dir=CACHE_DIR)


def phase_env(name: str, settings: Settings) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": settings.cache_dir,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the 8B engine holds ~86 GB (docs/gpu.md)
    return env


def phase_command(name: str, settings: Settings, result_path: Path, small: bool, limit_s: float) -> list[str]:
    """The phase's subprocess. Measuring phases stop 5 s before their time box kills them."""
    if name == "parity":
        # A hung test is cut by pytest-timeout before the phase's own box, so pytest reports.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--timeout={max(10, int(limit_s) - 15)}", *DEVICE_TESTS]
        return cmd + ["--collect-only"] if small else cmd  # --small: the files import and collect
    return [sys.executable, "-m", "tools.device.device_check", "--phase", name, "--phase-result", str(result_path),
            "--settings", settings.to_json(), "--deadline-s", f"{max(1.0, limit_s - 5.0):.1f}"]


def parse_pytest_summary(text: str) -> dict:
    """'3 failed, 40 passed, 2 skipped in 12.3s' -> counts (and 'collected' for --collect-only)."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    collected = re.search(r"(\d+) tests? collected", text)
    if collected:
        counts["collected"] = int(collected.group(1))
    return counts


def run_phase(name: str, settings: Settings, work: Path, log, small: bool, limit_s: float) -> dict:
    result_path = work / f"{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = phase_command(name, settings, result_path, small, limit_s)
    log.write(f"\n===== phase {name} (time box {limit_s:.0f} s): {' '.join(cmd[:6])} ...\n")
    log.flush()
    t0 = time.monotonic()
    record: dict = {}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=phase_env(name, settings), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=limit_s)
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
        record["note"] = f"killed at its {limit_s:.0f} s time box; what it had saved is kept"
    log.write(output)
    log.flush()
    if result_path.is_file():
        record.update(json.loads(result_path.read_text()))
    record.update(wall_s=round(time.monotonic() - t0, 1), returncode=rc)
    if name == "parity":
        record.update(summary=parse_pytest_summary(output[-3000:]),
                      failures=[line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))][:40])
    elif rc not in (0, None):
        record["error_tail"] = output[-2000:]
    return record


def orchestrate(out: Path, settings: Settings, small: bool, budget_s: float, phases: tuple[str, ...]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ferrox_device_check_"))
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    report: dict = {"small": small, "settings": dataclasses.asdict(settings), "budget_s": budget_s,
                    "peaks": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS},
                    "phases": {}, "notes": []}
    start = time.monotonic()
    # Each phase's share of the budget: its BUDGET_S over the selected phases' total, so a
    # run of a few phases gives each proportionally more (never more than what is left).
    share = budget_s / sum(BUDGET_S[name] for name in phases)
    with open(out / "device_check.log", "w") as log:
        for name in PHASES:
            left = budget_s - (time.monotonic() - start)
            if name not in phases:
                continue
            limit = min(BUDGET_S[name] * share, left)
            if limit < MIN_PHASE_S:
                report["notes"].append(f"phase {name} skipped: {left:.0f} s of the {budget_s:.0f} s budget left")
                continue
            record = run_phase(name, settings, work, log, small, limit)
            report["phases"][name] = record
            status = "ok" if record.get("returncode") == 0 else f"returncode {record.get('returncode')}"
            print(f"[device_check] {name}: {status} in {record['wall_s']} s", flush=True)
            if record.get("note"):
                report["notes"].append(f"phase {name}: {record['note']}")
            report["total_s"] = round(time.monotonic() - start, 1)
            (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
            (out / "device_check.md").write_text(render_markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for device_check.json / .md / .log")
    p.add_argument("--small", action="store_true", help="a tiny shape in float32: runs anywhere in about a minute")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the whole run's time box (default {DEFAULT_BUDGET_S:.0f} s; --small: {SMALL_BUDGET_S:.0f} s)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ", ".join(PHASES))
    p.add_argument("--engine-attention", default="auto", help="--attention-impl of the engine phase")
    p.add_argument("--cache-dir", default=CACHE_DIR, help="JAX persistent compile cache (default: under the "
                   "system temp folder, so a rerun on the same machine reads the compiled shapes back)")
    p.add_argument("--phase", choices=sorted(PHASE_FUNCTIONS), help=argparse.SUPPRESS)  # internal: one phase
    p.add_argument("--phase-result", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase:
        settings = Settings.from_json(args.settings)
        if args.deadline_s is not None:
            settings = dataclasses.replace(settings, deadline=time.monotonic() + args.deadline_s)
        result = PhaseResult(args.phase_result)
        PHASE_FUNCTIONS[args.phase](settings, result)
        result.save()
        return 0
    if not args.out:
        p.error("--out is required")
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        p.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    settings = dataclasses.replace(SMALL if args.small else FULL, engine_attention=args.engine_attention,
                                   cache_dir=args.cache_dir)
    budget_s = args.budget_s or (SMALL_BUDGET_S if args.small else DEFAULT_BUDGET_S)
    report = orchestrate(Path(args.out), settings, args.small, budget_s, phases)
    print(render_markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
