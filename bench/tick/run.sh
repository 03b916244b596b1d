#!/bin/bash
# The burst and speculative benchmarks before and after a change of the engine's tick, on one
# host, alternating: BEFORE and AFTER are two checkouts (git worktrees) with the kernels built.
#   BEFORE=/path/to/old AFTER=/path/to/new ROUNDS=3 bash bench/tick/run.sh
# Burst: both servers up, rounds alternating. Speculative: each checkout's own in-process
# tool (tools/bench/bench_speculative.py; tools/bench_speculative.py before the lab moved).
set -u
PY=${PY:-$(pwd)/.venv/bin/python}
OUT=${OUT:-results/tick}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
start() { (cd "$1" && exec "$PY" -m api.cli serve --model default --port "$2" --max-seqs 32 > "$OUT/server-$2.log" 2>&1) & }
start "$BEFORE" 18501
start "$AFTER" 18502
for p in 18501 18502; do for _ in $(seq 1 120); do curl -sf "localhost:$p/health" >/dev/null && break; sleep 2; done; done
for r in $(seq 1 "$ROUNDS"); do
  for side in 18501:before 18502:after; do
    "$PY" -m tools.bench.bench_burst --base-url "http://127.0.0.1:${side%%:*}" --label "${side##*:}" \
      --decode-rows 16 --burst 8 --prompt-len 512 --rounds 1 --seed $((100 * r)) \
      --result-json "$OUT/burst-${side##*:}-$r.json"
  done
done
pkill -f "api.cli serve --model default --port 1850"
spec() { if [ -f "$1/tools/bench/bench_speculative.py" ]; then echo tools.bench.bench_speculative; else echo tools.bench_speculative; fi; }
for r in $(seq 1 "$ROUNDS"); do
  for side in "$BEFORE":before "$AFTER":after; do
    dir=${side%%:*}
    (cd "$dir" && "$PY" -m "$(spec "$dir")" --model default --rounds 1 --workloads fix nothing --concurrency 1 32 \
       --result-json "$OUT/spec-${side##*:}-$r.json")
  done
done
