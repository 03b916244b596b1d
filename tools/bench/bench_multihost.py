"""What the multi-host step channel costs per step: a 2-process (or N-process) CPU cluster
on loopback, decode steps at each row count, timed in their parts.

Every process builds the same engine (`jax.distributed`, gloo, tensor parallel across the
processes); process 0 runs `tools.bench.bench_engine.bench_decode` through its BroadcastRunner,
the others `multihost.follow`. Per decode step it reports, as medians over the timed steps:

  * `to_bytes_ms`   the leader serializing the step's HostBatch;
  * `send_ms`       the leader's `sendall` of the frame to every follower;
  * `from_bytes_ms` a follower decoding it (magic and header checked, arrays copied);
  * `frame_bytes`   the frame's size;
  * `forward_dispatch_ms` the leader's `forward` verb (pad, block copies, dispatch) until it returns
                    (placing the inputs, any cross-process check of them, the enqueue);
  * `step_ms`       the whole step on the leader (broadcast, forward with its collectives,
                    sampling, fetch), and, with `--single`, the same step in one process
                    (tensor parallel 1), measured in alternating rounds with the cluster.

A follower's frame read is on the step's critical path (the collective waits for it), so
the channel's cost per step is about to_bytes + send + from_bytes plus one loopback hop.

    python -m tools.bench.bench_multihost --model default --rows 1 8 --single
    python -m tools.bench.bench_multihost --model /tmp/tiny --rows 1 8 --single
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _timed(owner, name: str, sink: list[tuple[int, float]], key) -> None:
    """Wraps `owner.name` to append (key(args, result), milliseconds) of each call to `sink`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        result = inner(*args, **kwargs)
        sink.append((key(args, result), (time.perf_counter() - t0) * 1e3))
        return result

    setattr(owner, name, wrapper)


def _engine(args, process_id: int | None, coordinator: str | None, processes: int):
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    multi = coordinator is not None
    config = EngineConfig(model=args.model, dtype="float32", quantization="none", block_size=16,
                          kv_blocks=args.kv_blocks, max_context=args.max_context, max_seqs=max(args.rows),
                          prefill_chunk=32, tensor_parallel=processes if multi else 1,
                          replicate_attention=multi and args.replicate_attention,
                          coordinator_address=coordinator, num_processes=processes if multi else None,
                          process_id=process_id, compile_cache_dir=args.compile_cache_dir)
    engine = Engine.load(config)
    engine.warmup()
    return engine


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_process(args) -> int:
    """One process of the cluster (or the single-process reference when --process-id is -1)."""
    from ferrox_jax import multihost
    from ferrox_jax.host_batch import HostBatch
    from tools.bench.bench_engine import bench_decode

    single = args.process_id < 0
    engine = _engine(args, None if single else args.process_id, None if single else args.coordinator,
                     args.processes)
    if not single and args.process_id > 0:  # a follower: decode what comes, report on the stop frame
        decoded: list[tuple[int, float]] = []  # (bucket rows, ms)
        _timed(HostBatch, "from_bytes", decoded, key=lambda _, batch: batch.num_rows)
        multihost.follow(engine.runner, multihost.step_channel_address(args.coordinator), args.process_id)
        Path(args.out).write_text(json.dumps({"from_bytes_ms": decoded}))
        os._exit(0)
    encoded: list[tuple[int, float]] = []  # (frame bytes, ms)
    sent: list[tuple[bytes, float]] = []  # (frame kind, ms): the heartbeats' too
    dispatched: list[tuple[None, float]] = []
    inner = engine.runner if single else engine.runner.runner  # the leader's own part of each step
    _timed(inner, "forward", dispatched, key=lambda *_: None)
    if not single:
        _timed(HostBatch, "to_bytes", encoded, key=lambda _, data: len(data))
        _timed(engine.runner.channel, "send", sent, key=lambda args, _: args[0])  # the frame kind
    result = {}
    for rows in args.rows:
        encoded.clear(), sent.clear(), dispatched.clear()
        decode = bench_decode(engine, [rows], [args.context], args.steps, greedy=True)
        step = decode[f"decode_{rows}_rows_{args.context}_context"]
        result[rows] = {"step_ms": step["step_ms"], "to_bytes_ms": _median([ms for _, ms in encoded[1:]]),
                        "send_ms": _median([ms for kind, ms in sent[1:] if kind == multihost.BATCH]), "steps": len(dispatched),
                        "forward_dispatch_ms": _median([ms for _, ms in dispatched[1:]]),
                        "frame_bytes": encoded[-1][0] if encoded else None}
    if not single:
        multihost.close_all()
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)


def _free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


def _launch(args, processes: int, out_dir: Path, round_no: int) -> list[dict]:
    coordinator = f"127.0.0.1:{_free_port_pair()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    ids = [-1] if processes == 1 else list(range(processes))
    procs, outs = [], []
    for i in ids:
        out = out_dir / f"round{round_no}-p{processes}-{i}.json"
        outs.append(out)
        cmd = [sys.executable, "-m", "tools.bench.bench_multihost", "--model", args.model, "--rows", *map(str, args.rows),
               "--context", str(args.context), "--steps", str(args.steps), "--kv-blocks", str(args.kv_blocks),
               "--max-context", str(args.max_context), "--process-id", str(i), "--processes", str(processes),
               "--coordinator", coordinator, "--out", str(out)]
        if args.compile_cache_dir:
            cmd += ["--compile-cache-dir", args.compile_cache_dir]
        if args.replicate_attention:
            cmd.append("--replicate-attention")
        log = open(out_dir / f"round{round_no}-p{processes}-{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for proc in procs:
            if proc.wait(900) != 0:
                raise SystemExit(f"a bench process exited {proc.returncode}; logs in {out_dir}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(out.read_text()) for out in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kv-blocks", type=int, default=160)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="cluster and single-process runs, alternating")
    p.add_argument("--single", action="store_true", help="also time the single-process step")
    p.add_argument("--replicate-attention", action="store_true", help="shard only the MLP and the vocabulary")
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_id is not None:
        return run_process(args)
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="bench_multihost_"))
    rounds: list[dict] = []
    for r in range(args.rounds):
        cluster = _launch(args, args.processes, out_dir, r)
        decoded = cluster[1]["from_bytes_ms"]
        entry = {"cluster": cluster[0], "follower_from_bytes_ms": {
            str(rows): _median([ms for n, ms in decoded if n == rows]) for rows in sorted({n for n, _ in decoded})}}
        if args.single:
            entry["single"] = _launch(args, 1, out_dir, r)[0]
        rounds.append(entry)
    text = json.dumps({"model": args.model, "processes": args.processes, "context": args.context,
                       "steps": args.steps, "rounds": rounds}, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
