"""`ferrox serve` start-up to ready, for one or more checkouts, runs alternated.

    python bench/startup/restart.py --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf \
        --checkout before=/tmp/before --checkout after=. --runs 3 --cache-root /tmp/startup-cache

Each checkout serves from its own directory (its own code is the one imported) with its own
compile cache dir (`<cache-root>/<name>`), so the executable store of one never serves the
other. With `--cold`, each cache dir is emptied before the checkout's first run (that run is
the first start; the later ones are restarts on what it stored). Runs alternate between the
checkouts, round by round, the order swapped every round.

Per run, from the parent's clock: seconds from spawning the process to its `listening` event
(the interpreter, the imports, the app: stdout JSON, `api/process_knobs.py`) and to its
`ready` event (`/health` 200); the server's CPU seconds (all threads) at `ready` (`cpu_s`:
on a busy host the wall clock waits for the cores, the CPU seconds much less); from the server's log: the load and warm-up seconds of its
ready block and the store's "N of M executables loaded in X s" line; and the load average at
the start. The model file is read once before each run (untimed), so that every run finds its
pages in the page cache as a restart does (on a host short of memory they are evicted between
runs, and the load then waits on the disk); `--evict` drops them instead (posix_fadvise
DONTNEED on that file alone), as a start after a reboot finds them. Prints one JSON line per
run, then the best of each checkout; the server is stopped with SIGTERM after each run.
`--idle S` sleeps S seconds before each run (a restart on a host that was idle: see `--help`).

With `--probe`, once ready each run also answers one greedy completion (`PROBE`, 8 tokens with
their logprobs) and reads `/metrics`: `probe` is a hash of the tokens and logprobs (every
checkout and run should print the same one: the same model, the same executables) and
`recompiles` the engine's compiles after warm-up (0: every shape was ready at "ready").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LOAD_RE = re.compile(r"load: ([\d.]+) s, warm-up: ([\d.]+) s")
STORE_RE = re.compile(r"executable store: (\d+) of (\d+) executables loaded in ([\d.]+) s")
RECOMPILES_RE = re.compile(r"^ferrox_recompiles_after_warmup(?:_total)? ([\d.]+)", re.M)
PROBE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, all its threads (/proc/PID/stat), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def probe(port: int) -> dict:
    """One greedy completion's hash (tokens and logprobs) and the compiles after warm-up."""
    base = f"http://127.0.0.1:{port}"
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(PROBE).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        choice = json.load(r)["choices"][0]
    answer = json.dumps([choice["text"], choice["logprobs"]], sort_keys=True).encode()
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        recompiles = RECOMPILES_RE.search(r.read().decode())
    return {"probe": hashlib.sha256(answer).hexdigest()[:12],
            "recompiles": float(recompiles.group(1)) if recompiles else None}


def one_run(name: str, checkout: Path, model: str, cache: Path, port: int, extra: list[str],
            timeout_s: float, evict: bool = False, with_probe: bool = False) -> dict:
    python = os.environ.get("FERROX_BENCH_PYTHON", sys.executable)
    cmd = [python, "-m", "api.cli", "serve", "--model", model, "--max-seqs", "8", "--max-context", "512",
           "--compile-cache-dir", str(cache), "--port", str(port), "--log-level", "info", *extra]
    err_path = cache.parent / f"{name}-{port}.log"
    with open(model, "rb") as f:
        if evict:  # this file's pages out of the page cache: the load reads the disk
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        else:  # the file's pages in the page cache, as a restart usually finds them
            while f.read(1 << 24):
                pass
    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.PIPE, stderr=err, text=True)
        events: dict[str, float] = {}
        cpu = None  # the server's CPU seconds at its ready event: what load on the host inflates least
        try:
            for line in proc.stdout:
                try:
                    event = json.loads(line).get("event")
                except (ValueError, AttributeError):
                    continue
                events[event] = time.perf_counter() - t0
                if event == "ready":
                    cpu = cpu_seconds(proc.pid)
                if event == "ready" or time.perf_counter() - t0 > timeout_s:
                    break
            probed = probe(port) if with_probe and "ready" in events else {}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log = err_path.read_text()
    load = LOAD_RE.search(log)
    store = STORE_RE.search(log)
    return {"checkout": name, "listening_s": round(events.get("listening", -1), 2),
            "ready_s": round(events.get("ready", -1), 2), "cpu_s": None if cpu is None else round(cpu, 2),
            "load_s": float(load.group(1)) if load else None, "warmup_s": float(load.group(2)) if load else None,
            "store_loaded": f"{store.group(1)}/{store.group(2)} in {store.group(3)} s" if store else None,
            "load_avg": round(load_avg, 2), "exit": proc.returncode, **probed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--checkout", action="append", required=True, help="NAME=DIR (repeatable)")
    parser.add_argument("--runs", type=int, default=3, help="rounds (one run of each checkout per round)")
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--cold", action="store_true", help="empty each cache dir before its first run")
    parser.add_argument("--evict", action="store_true",
                        help="evict the model file from the page cache before each run instead of reading it")
    parser.add_argument("--probe", action="store_true",
                        help="once ready, one greedy completion (its hash) and the compiles after warm-up")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds of sleep before each run: in a VM with free page reporting the memory the "
                             "last run freed goes back to the host, and the next run's first touch pays for it "
                             "(bench/startup/first_touch.py)")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("extra", nargs="*", help="more `ferrox serve` flags, after --")
    args = parser.parse_args()
    checkouts = [(n, Path(d).resolve()) for n, _, d in (c.partition("=") for c in args.checkout)]
    root = Path(args.cache_root)
    root.mkdir(parents=True, exist_ok=True)
    if args.cold:
        for name, _ in checkouts:
            shutil.rmtree(root / name, ignore_errors=True)
    results = []
    for round_ in range(args.runs):
        order = checkouts if round_ % 2 == 0 else checkouts[::-1]
        for name, checkout in order:
            time.sleep(args.idle)
            result = one_run(name, checkout, args.model, root / name, args.port, args.extra, args.timeout, args.evict,
                             args.probe)
            result["round"] = round_
            results.append(result)
            print(json.dumps(result), flush=True)
    for name, _ in checkouts:
        mine = [r for r in results if r["checkout"] == name and r["ready_s"] > 0]
        if mine:
            best = min(mine, key=lambda r: r["ready_s"])
            print(json.dumps({"best": name, **best}), flush=True)
        # The restarts: runs that loaded every executable from the store (a first start compiles).
        restarts = [r for r in mine if r["store_loaded"] and r["store_loaded"].split()[0].split("/")[0]
                    == r["store_loaded"].split()[0].split("/")[1] != "0"]
        if restarts:
            summary = {"summary": name, "restarts": len(restarts),
                       "load_avg": [min(r["load_avg"] for r in restarts), max(r["load_avg"] for r in restarts)]}
            for field in ("ready_s", "cpu_s", "listening_s", "load_s", "warmup_s"):
                values = [r[field] for r in restarts if r[field] is not None]
                if values:
                    summary[field] = {"best": min(values), "median": round(statistics.median(values), 2)}
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
