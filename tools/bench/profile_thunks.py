"""Where the compiled forward's time goes, thunk by thunk, grouped by what each thunk does.

    python -m tools.bench.profile_thunks --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --rows 8

Loads the engine as `ferrox serve` would, runs the runner's own compiled forward on a padded
decode batch of `--rows` rows, and records a `jax.profiler` trace of `--forwards` forwards:
XLA CPU emits one trace event per thunk. Each event is mapped to its instruction in the
optimized HLO and grouped: custom calls by target, fusions by the set of ops inside them
(so "fusion[add,concatenate,cosine,...]" says a fusion evaluates cos), other thunks by
opcode. Prints mean ms per forward and thunks per forward of each group, largest first
(`--json F` also writes them). Timings move with the machine's load; compare groups within
one run. Events of thunks inside a conditional's or loop's branches are not grouped (the
conditional's own event covers them).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax

_SKIP_OPS = {"parameter", "constant", "broadcast", "bitcast", "reshape", "convert"}


def thunk_kinds(hlo: str) -> dict[str, str]:
    """Instruction name -> group, for the ENTRY computation's instructions."""
    entry = hlo[hlo.find("ENTRY"):]
    bodies = {m.group(1): m.group(2) for m in re.finditer(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}
    kinds = {}
    for line in entry.splitlines():
        target = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = .*custom_call_target="([^"]+)"', line)
        if target:
            kinds[target.group(1)] = f"custom-call {target.group(2)}"
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", line)
        if not m:
            continue
        name, opcode = m.groups()
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if opcode == "fusion" and called:
            ops = set(re.findall(r" = \S+ ([\w\-]+)\(", bodies.get(called.group(1), ""))) - _SKIP_OPS
            kinds[name] = "fusion[" + ",".join(sorted(ops)) + "]"
        else:
            kinds[name] = opcode
    return kinds


def group_events(events, kinds: dict[str, str], forwards: int) -> list[dict]:
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        kind = kinds.get(e.get("name", ""))
        if e.get("ph") == "X" and kind is not None:
            total[kind] += e["dur"]
            count[kind] += 1
    rows = [{"kind": k, "ms_per_forward": t / forwards / 1e3, "thunks_per_forward": count[k] / forwards}
            for k, t in total.items()]
    return sorted(rows, key=lambda r: -r["ms_per_forward"])


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from ferrox_jax.host_batch import HostBatch
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from tools.bench.bench_engine import row_tables

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=100, help="each row's position")
    p.add_argument("--chunk", type=int, default=0,
                   help="a prompt chunk of this many tokens at position 0 beside the rows (--rows 0: the chunk alone)")
    p.add_argument("--forwards", type=int, default=10, help="forwards traced")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    engine = Engine.load(EngineConfig(model=args.model, quantization=args.quantization, max_context=args.max_context,
                                      max_seqs=max(args.rows + (args.chunk > 0), 1)))
    runner = engine.runner
    chunk_blocks = -(-args.chunk // runner.block_size)
    tables = row_tables(runner, args.rows, args.context + 1, extra_blocks=chunk_blocks)
    base = 1 + sum(map(len, tables))  # the chunk's blocks follow the rows'
    plan = StepPlan(decode=tuple(
        RowPlan(row_id=r, token_ids=(7,), start_pos=args.context, block_ids=tables[r], sample=True,
                sampling=RowSampling(temperature=0.0)) for r in range(args.rows)),
        chunks=tuple(RowPlan(row_id=args.rows, token_ids=tuple(range(7, 7 + args.chunk)), start_pos=0,
                             block_ids=tuple(range(base, base + chunk_blocks)),
                             sample=True, sampling=RowSampling(temperature=0.0), num_prompt_tokens=args.chunk)
                     for _ in range(args.chunk > 0)))
    shape, _, inputs = runner._pad(HostBatch.build(plan, runner.geometry))

    def forward():
        jax.block_until_ready(runner._run_forward(shape, inputs).logits)

    for _ in range(3):
        forward()
    exe = runner._compiled[("forward", *shape.key)]
    kinds = thunk_kinds(exe.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.forwards):
            forward()
        jax.profiler.stop_trace()
        traces = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
        if not traces:
            print("the profiler wrote no trace", file=sys.stderr)
            return 1
        with gzip.open(traces[-1]) as f:
            events = json.load(f)["traceEvents"]
    engine.shutdown()
    rows = group_events(events, kinds, args.forwards)
    for r in rows:
        print(f"{r['ms_per_forward']:9.3f} ms {r['thunks_per_forward']:6.1f}x  {r['kind']}")
    other = sum(r["ms_per_forward"] for r in rows if not r["kind"].startswith("custom-call"))
    print(f"{other:9.3f} ms in thunks other than custom calls (rows {args.rows}, chunk {args.chunk}, load "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])})")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"model": engine.model_name, "rows": args.rows, "forwards": args.forwards, "groups": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
