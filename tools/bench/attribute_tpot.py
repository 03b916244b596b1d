"""Where a served token's time goes at one stream: the step, the engine and the server, alternated.

    python -m tools.bench.attribute_tpot --rounds 3 -- --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --max-seqs 8

Runs `ferrox serve` with the given flags in this process (as `tools/bench/profile_tick.py`
does), its runner wrapped through the engine builder's `wrap_runner` hook (`TimedRunner`:
each step's `forward` and `sample` calls timed), and once it is up runs three kinds of
round on the same engine, each kind first in turn:

  step     one decode row at `--input-len` tokens of context stepped back to back through
           the runner's verbs (`run_plan`, from this thread while the engine is idle): host
           batch, forward, sample, fetch, step output; no scheduler, no events
  engine   `--requests` greedy requests submitted straight to the engine (`Engine.submit`),
           one at a time; no HTTP, no event loop, no client
  served   the same through the server: `tools/bench/bench_serving.py` as a separate client
           process, streaming completions at concurrency 1

Requests have `--input-len` random prompt tokens and `--output-len` output tokens
(ignore_eos). Every event is timed on the owner thread as it is delivered (the engine's
`submit` is wrapped here to do it), with the engine's counters (`BatcherStats`) and every
thread's CPU time (/proc/self/task, and the client's /proc/PID) read at each request's first
token and at its end, so the figures cover decode only:

  TPOT           the client's p50 (served), else the owner's: (last - first token) / tokens
  owner's TPOT   from the owner's delivery times, median over requests
  step ms        `device_s` per tick: forward call to step output (grammar masks included)
  tick host      `host_s` per tick: the rest of the tick (schedule, host batch, stop checks,
                 detokenizing, the snapshot, the events handed on)
  forward call   the runner's `forward` (padding, dispatch); sample call: its `sample` (the
                 sampler's dispatch, the wait for the device, the fetch, unpadding)
  gap            from one step's fetch to the next step's forward: the owner's host work
                 outside the runner, plus any wait for the GIL
  CPU ms/tok     owner (the engine's thread), loop (the main thread: Hypercorn, the route,
                 SSE), xla (every other thread of the server), client (the client process)

served - engine is what the HTTP side and the client cost a token at the engine's pace;
engine - step is the scheduler's tick. The step round writes its KV into blocks from 1 on
(as `bench_engine.bench_decode` does): the prompts of later rounds are random and share no
prefix with what the prefix cache held there. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ferrox_jax.runner_protocol import RunnerWrapper
from tools.bench.profile_tick import _wait_ready, thread_cpu_s


class TimedRunner(RunnerWrapper):
    """The served engine's runner, its two step verbs timed (the builder's `wrap_runner` hook):
    per step (forward called, forward returned, sample called, sample returned)."""

    steps: list[tuple[float, float, float, float]] = []

    def forward(self, batch):
        t0 = time.perf_counter()
        pending = self.runner.forward(batch)
        self._forward = (t0, time.perf_counter())
        return pending

    def sample(self, pending, bitmask):
        t2 = time.perf_counter()
        arrays = self.runner.sample(pending, bitmask)
        TimedRunner.steps.append((*self._forward, t2, time.perf_counter()))
        return arrays


def step_parts(steps: list[tuple[float, float, float, float]], windows: list[tuple[float, float]]) -> dict:
    """Medians over the decode steps (those dispatched inside a request's first-to-last-token
    window) of: the forward's call (padding and dispatch), the sample's call (its dispatch,
    the wait for the device, the fetch, unpadding), and the gap from one step's fetch to the
    next step's forward: the owner's host work outside the runner (step output, stop checks,
    detokenizing, the snapshot, the events, the inbox, scheduling, the host batch)."""
    forward, sample, gap = [], [], []
    for prev, step in zip(steps, steps[1:]):
        if not any(lo < step[0] <= hi for lo, hi in windows):
            continue
        forward.append(step[1] - step[0])
        sample.append(step[3] - step[2])
        gap.append(step[0] - prev[3])
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")
    return {"forward_call_ms": med(forward), "sample_call_ms": med(sample), "gap_ms": med(gap)}


class _Server:
    """The in-process server's engine, captured as `ferrox serve` loads it, with every
    event of every job timed on the owner thread as it is delivered (its `submit` wrapped):
    (perf_counter, tokens in the event, the engine's device_s, host_s and ticks then; the
    snapshot is published before the tick's events are delivered, so it counts that tick)."""

    engine = None
    events: dict[str, list[tuple[float, int, float, float, int]]] = {}
    cpu: dict[str, list[dict]] = {}  # request id -> every thread's CPU at its first token and at its end
    client_pid: int | None = None

    @classmethod
    def capture(cls) -> None:
        import api.cli

        load = api.cli.load_engine

        def load_and_keep(*args, **kwargs):
            cls.engine = engine = load(*args, **kwargs)
            submit = engine.submit

            def timed_submit(job, on_event):
                times = cls.events.setdefault(job.request_id, [])
                cpu = cls.cpu.setdefault(job.request_id, [])

                def timed_on_event(event):
                    if event.token_ids:
                        s = engine.stats()
                        times.append((time.perf_counter(), len(event.token_ids), s.device_s, s.host_s, s.ticks))
                    if len(times) == 1 and not cpu or event.finish_reason is not None:
                        cpu.append(cls.cpu_now())
                    on_event(event)

                return submit(job, timed_on_event)

            engine.submit = timed_submit
            return engine

        api.cli.load_engine = load_and_keep

    @classmethod
    def cpu_now(cls) -> dict:
        """CPU seconds of every thread of this process and of the client process."""
        out = {"threads": thread_cpu_s(), "client": 0.0}
        if cls.client_pid is not None:
            try:
                with open(f"/proc/{cls.client_pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out["client"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
        return out


def owner_side(events: list[list[tuple[float, int, float, float, int]]]) -> dict:
    """Per request, from its first token's event to its last: the TPOT the owner delivered
    at, and the device / host time per tick of those ticks (decode only; medians over requests)."""
    tpot, step, host = [], [], []
    for times in events:
        if len(times) < 2:
            continue
        (t0, k0, d0, h0, n0), (t1, _, d1, h1, n1) = times[0], times[-1]
        tokens = sum(k for _, k, *_ in times) - k0
        ticks = max(n1 - n0, 1)
        tpot.append((t1 - t0) / tokens)
        step.append((d1 - d0) / ticks)
        host.append((h1 - h0) / ticks)
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")
    return {"owner_tpot_ms": med(tpot), "step_ms": med(step), "tick_host_ms": med(host)}


def decode_cpu(windows: list[list[dict]], this_thread_is: str = "") -> dict[str, float]:
    """CPU seconds per thread group over the requests' decode windows (first token to end);
    `this_thread_is` "owner": the calling thread drove the steps (a step round)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    owner = threading.get_native_id() if this_thread_is == "owner" else next(
        (tid for tid, n in names.items() if n == "ferrox-batcher"), None)
    main_id = threading.main_thread().native_id
    parts = {"owner": 0.0, "loop": 0.0, "xla": 0.0, "client": 0.0}
    for window in windows:
        if len(window) < 2:
            continue
        before, after = window[0], window[-1]
        for tid, cpu in after["threads"].items():
            if names.get(tid, "").startswith("attribute-tpot") and tid != owner:
                continue
            used = cpu - before["threads"].get(tid, 0.0)
            parts["owner" if tid == owner else "loop" if tid == main_id else "xla"] += used
        parts["client"] += after["client"] - before["client"]
    return parts


def engine_round(engine, args: argparse.Namespace, seed: int) -> dict:
    """`args.requests` jobs straight to the engine, one at a time (greedy, ignore_eos)."""
    from ferrox_jax.request import Job, RowSampling

    tokens = 0
    for i in range(args.requests):
        prompt = tuple(int(t) for t in np.random.RandomState(seed * 1000 + i).randint(10, 1000, args.input_len))
        done = threading.Event()
        counted = []

        def on_event(event, done=done, counted=counted):
            counted.append(len(event.token_ids))
            if event.finish_reason is not None:
                done.set()

        engine.submit(Job(f"attr-{seed}-{i}", prompt, args.output_len, RowSampling(temperature=0.0),
                          ignore_eos=True, min_tokens=args.output_len), on_event)
        done.wait(600)
        tokens += sum(counted)
    return {"tokens": tokens}


def served_round(base_url: str, args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        client = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.bench_serving", "--base-url", base_url, "--input-len",
             str(args.input_len), "--output-len", str(args.output_len), "--num-requests", str(args.requests),
             "--max-concurrency", "1", "--seed", str(seed), "--no-progress", "--result-json", path],
            stdout=subprocess.DEVNULL)
        _Server.client_pid = client.pid
        if client.wait() != 0:
            raise RuntimeError(f"bench_serving exited {client.returncode}")
        with open(path) as f:
            result = json.load(f)
    return {"tpot_ms_p50": result["median_tpot_ms"], "tokens": int(result["total_output_tokens"])}


def step_round(engine, args: argparse.Namespace) -> dict:
    """One greedy decode row at `--input-len` tokens of context stepped back to back through the
    runner's verbs (`run_plan`: host batch, forward, sample, fetch, step output), no batcher."""
    from tools.bench.bench_engine import bench_decode

    before = {"threads": thread_cpu_s(), "client": 0.0}
    steps = args.output_len * 2
    out = bench_decode(engine, [1], [args.input_len], steps, greedy=True)
    step_ms = out[f"decode_1_rows_{args.input_len}_context"]["step_ms"]
    return {"tpot_ms": step_ms, "owner_tpot_ms": step_ms, "step_ms": step_ms, "tick_host_ms": 0.0,
            "decode_tokens": steps, "cpu": [[before, {"threads": thread_cpu_s(), "client": 0.0}]]}


def run_round(kind: str, base_url: str, args: argparse.Namespace, seed: int) -> dict:
    engine = _Server.engine
    _Server.events.clear()
    _Server.cpu.clear()
    _Server.client_pid = None
    TimedRunner.steps.clear()
    if kind == "step":
        out = step_round(engine, args)
        parts = decode_cpu(out.pop("cpu"), this_thread_is="owner")
        return {"kind": kind, **out, "load": os.getloadavg()[0],
                "cpu_ms_per_token": {k: 1e3 * v / out["decode_tokens"] for k, v in parts.items()}}
    out = engine_round(engine, args, seed) if kind == "engine" else served_round(base_url, args, seed)
    owner = owner_side(list(_Server.events.values()))
    owner.update(step_parts(list(TimedRunner.steps), [(t[0][0], t[-1][0]) for t in _Server.events.values() if t]))
    decode_tokens = sum(sum(k for _, k, *_ in times) - times[0][1] for times in _Server.events.values() if times)
    parts = decode_cpu(list(_Server.cpu.values()))
    return {"kind": kind, "tpot_ms": out.get("tpot_ms_p50", owner["owner_tpot_ms"]), **owner,
            "decode_tokens": decode_tokens, "load": os.getloadavg()[0],
            "cpu_ms_per_token": {k: 1e3 * v / max(decode_tokens, 1) for k, v in parts.items()}}


def format_rows(rows: list[dict]) -> str:
    lines = ["| round | kind | load | TPOT p50 ms (client) | owner's TPOT ms | step (device_s) ms | tick host ms | "
             "forward call ms | sample call ms | fetch-to-forward gap ms | owner | loop | xla | client (CPU ms/tok) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        c = r["cpu_ms_per_token"]
        nan = float("nan")
        lines.append(f"| {i // 3 + 1} | {r['kind']} | {r['load']:.1f} | {r['tpot_ms']:.2f} | {r['owner_tpot_ms']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['tick_host_ms']:.2f} | {r.get('forward_call_ms', nan):.2f} | "
                     f"{r.get('sample_call_ms', nan):.2f} | {r.get('gap_ms', nan):.2f} | {c['owner']:.2f} | "
                     f"{c['loop']:.2f} | {c['xla']:.2f} | {c['client']:.2f} |")
    for kind in ("step", "engine", "served"):
        tp = [r["tpot_ms"] for r in rows if r["kind"] == kind]
        if tp:
            lines.append(f"{kind}: TPOT best {min(tp):.2f} ms, median {statistics.median(tp):.2f} ms over {len(tp)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", default=None, help="write every round here")
    args = p.parse_args(argv[:split])
    serve_args = argv[split + 1:]
    if "--port" not in serve_args:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            serve_args += ["--port", str(s.getsockname()[1])]
    base_url = f"http://127.0.0.1:{serve_args[serve_args.index('--port') + 1]}"
    rows: list[dict] = []
    report: list[str] = []

    def run() -> None:
        try:
            _wait_ready(base_url)
            served_round(base_url, argparse.Namespace(**{**vars(args), "requests": 1}), 999)  # warm both paths
            engine_round(_Server.engine, argparse.Namespace(**{**vars(args), "requests": 1}), 999)
            for r in range(args.rounds):
                kinds = ("step", "engine", "served")
                for kind in kinds[r % 3:] + kinds[:r % 3]:  # each kind first in turn
                    rows.append(run_round(kind, base_url, args, seed=r))
                    print(json.dumps(rows[-1]), flush=True)
            report.append(format_rows(rows))
        except BaseException as e:  # reported after the server stops
            report.append(f"measurement failed: {e!r}")
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    _Server.capture()
    threading.Thread(target=run, name="attribute-tpot", daemon=True).start()
    from api.cli import main as cli_main

    cli_main(["serve", *serve_args], wrap_runner=TimedRunner)
    print("\n".join(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
