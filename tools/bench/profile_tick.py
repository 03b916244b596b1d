"""Where a served token's CPU goes outside the step: `ferrox serve` in this process, one stream.

    python -m tools.bench.profile_tick --requests 4 --output-len 128 -- --model default --max-seqs 8
    python -m tools.bench.profile_tick --profile -- --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --max-seqs 8

Runs `ferrox serve` with the given flags in this process (its main thread: the asyncio loop,
as the real command), and `tools/bench/bench_serving.py` as a separate client process at
concurrency 1, streaming completions. Around the measured requests it reads every thread's
CPU time from /proc/self/task (user + system, clock ticks), so the split holds on a loaded
host where wall times do not:

  owner      the engine's owner thread ("ferrox-batcher"): scheduling, the host batch,
             padding, dispatch, the fetch's wait if it spins, step output, stop checks,
             detokenizing, the events handed to the loop
  loop       the main thread: Hypercorn, the route, SSE framing and JSON, one wake-up per event
  xla        every other thread (XLA's intra-op pool and its dispatch threads): the step
  client     the client process (its own CPU, not the server's; on a 2-core host it competes)

each in ms per output token. With `--profile`, a deterministic profiler (cProfile) runs in the
owner and loop threads during the measured requests and the top functions of each are printed
with their own and cumulative ms per token; the profiler inflates Python time (often 2x), so
read its split, not its total, and take totals from a run without it. Timings are never
asserted anywhere.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[int, float]:
    """native thread id -> user + system CPU seconds, every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (stat fields 14, 15)
    return out


class ThreadProfiles:
    """One cProfile per Python thread, switched on and off together by `on`: each thread
    switches its own (a profiler can only be switched from inside its thread) through a
    light profile hook that reads `on` at every Python call while it is off (`install`)."""

    def __init__(self) -> None:
        self.profiles: dict[str, cProfile.Profile] = {}
        self.on = False

    def install(self) -> None:
        """In the calling thread (the main one) and every thread started afterwards."""

        def start_hook(*_args):
            sys.setprofile(None)
            if not threading.current_thread().name.startswith("profile-tick"):
                sys.setprofile(self._hook_for(threading.current_thread().name))

        threading.setprofile(start_hook)
        sys.setprofile(self._hook_for(threading.current_thread().name))

    def _hook_for(self, thread_name: str):
        profile = self.profiles[thread_name] = cProfile.Profile(time.thread_time)  # CPU, not wall: holds under load

        def hook(_frame, _event, _arg):
            if self.on:
                sys.setprofile(None)
                profile.enable()  # replaces this hook; it stays on until the process ends

        return hook

    def report(self, name: str, per: int, top: int) -> str:
        """The thread's `top` functions by own time, in ms and calls per output token."""
        profile = self.profiles.get(name)
        if profile is None:
            return f"(no profile for thread {name!r})"
        profile.snapshot_stats()  # reads it while it runs (create_stats would disable this thread's)
        rows = sorted(profile.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        lines = [f"  {'own ms/tok':>10} {'cum ms/tok':>10} {'calls/tok':>9}  function"]
        for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows:
            where = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({func})"
            lines.append(f"  {1e3 * tottime / per:10.3f} {1e3 * cumtime / per:10.3f} {ncalls / per:9.2f}  {where}")
        return "\n".join(lines)


def _wait_ready(base_url: str, timeout_s: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def _client(base_url: str, args: argparse.Namespace, num_requests: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, "-m", "tools.bench.bench_serving", "--base-url", base_url,
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--num-requests", str(num_requests), "--max-concurrency", "1",
                        "--warmup-requests", str(warmup), "--no-progress", "--result-json", path],
                       check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)


def measure(base_url: str, args: argparse.Namespace, profiles: ThreadProfiles | None) -> tuple[str, int]:
    _wait_ready(base_url)
    _client(base_url, args, 1, 1)  # warm the route, the tokenizer and the client's imports
    names = {t.native_id: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().native_id
    before, children_before = thread_cpu_s(), os.times()
    if profiles is not None:
        profiles.on = True
    result = _client(base_url, args, args.requests, 0)
    after, children_after = thread_cpu_s(), os.times()
    tokens = int(result.get("total_output_tokens") or result.get("total_output") or args.requests * args.output_len)
    owner = next((tid for tid, n in names.items() if n == "ferrox-batcher"), None)
    parts = {"owner": 0.0, "loop": 0.0, "xla": 0.0}
    for tid, cpu in after.items():
        used = cpu - before.get(tid, 0.0)
        parts["owner" if tid == owner else "loop" if tid == main_id else "xla"] += used
    parts["client"] = (children_after.children_user + children_after.children_system
                       - children_before.children_user - children_before.children_system)
    lines = [f"{tokens} output tokens over {args.requests} requests at c1; TPOT p50 "
             f"{result.get('median_tpot_ms', float('nan')):.2f} ms, mean {result.get('mean_tpot_ms', float('nan')):.2f} "
             f"ms (client side, wall); load average {os.getloadavg()[0]:.2f}",
             "CPU ms per output token: " + ", ".join(f"{k} {1e3 * v / tokens:.3f}" for k, v in parts.items())]
    return "\n".join(lines), tokens


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="cProfile the owner and loop threads")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv[:split])
    serve_args = argv[split + 1:]
    if "--port" in serve_args:
        port = int(serve_args[serve_args.index("--port") + 1])
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve_args += ["--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    profiles = ThreadProfiles() if args.profile else None
    report: list[str] = []

    def run() -> None:
        try:
            text, tokens = measure(base_url, args, profiles)
            report.append(text)
            if profiles is not None:
                for name in ("ferrox-batcher", "MainThread"):
                    report.append(f"\n{name} (cProfile, per output token):\n{profiles.report(name, tokens, args.top)}")
        except BaseException as e:  # reported after the server stops
            report.append(f"measurement failed: {e!r}")
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    if profiles is not None:
        profiles.install()
    threading.Thread(target=run, name="profile-tick", daemon=True).start()
    from api.cli import main as cli_main

    cli_main(["serve", *serve_args])
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
