#!/usr/bin/env bash
# A burst of 8 distinct 512-token prompts into 16 decoding rows, side by side: this tree
# against the tree before the unified step (BASE, a checkout of 9d499cb with its own
# .venv), both servers up, rounds alternating (tools/bench/bench_burst.py). Run from the
# repository root on a quiet machine:  BASE=/path/to/base bash bench/unified_step/run.sh
set -u
OUT=${OUT:-results/unified_step}  # raw results, git-ignored; bench/summarize.py keeps one summary
mkdir -p $OUT
BASE=${BASE:?set BASE to a checkout of 9d499cb with its .venv built}
ROUNDS=${ROUNDS:-3}
source bench/serving.sh
.venv/bin/ferrox serve --host 127.0.0.1 --port 8402 --model default > $OUT/new-server.log 2>&1 &
new=$!
(cd "$BASE" && .venv/bin/ferrox serve --host 127.0.0.1 --port 8401 --model default) > $OUT/base-server.log 2>&1 &
base=$!
trap 'kill $new $base 2>/dev/null' EXIT
wait_health http://127.0.0.1:8402/health || { echo "the new server did not start"; exit 1; }
wait_health http://127.0.0.1:8401/health || { echo "the base server did not start"; exit 1; }
for r in $(seq 1 $ROUNDS); do
  .venv/bin/python -m tools.bench.bench_burst --base-url http://127.0.0.1:8402 --label unified --seed $((r * 100)) \
    --result-json $OUT/unified-r$r.json
  .venv/bin/python -m tools.bench.bench_burst --base-url http://127.0.0.1:8401 --label base-9d499cb --seed $((r * 100)) \
    --result-json $OUT/base-r$r.json
done
curl -s http://127.0.0.1:8402/admin/stats > $OUT/unified-admin-stats.json
curl -s http://127.0.0.1:8401/admin/stats > $OUT/base-admin-stats.json
