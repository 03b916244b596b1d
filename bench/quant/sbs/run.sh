#!/bin/bash
# Side-by-side: llama.cpp peer vs ferrox none / w8a8 / int8, concurrency 1 and 32, one run.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results/quant/sbs}  # result files (git-ignored), under the repository root
mkdir -p $OUT
. bench/serving.sh  # bench, wait_health, run_peer
date; uptime
run_peer /tmp/llamacpp-venv/bin/python
for q in none w8a8 int8; do
  date; uptime
  .venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default --quantization $q > $OUT/ferrox-$q.log 2>&1 &
  SRV=$!
  wait_health http://127.0.0.1:8383/health || echo "ferrox $q did not start"
  if [ $q = int8 ]; then N1=4; else N1=16; fi
  bench http://127.0.0.1:8383 ferrox-$q 1 $N1 $OUT/ferrox-$q-c1.json
  if [ $q != int8 ]; then bench http://127.0.0.1:8383 ferrox-$q 32 128 $OUT/ferrox-$q-c32.json; fi
  curl -s http://127.0.0.1:8383/admin/stats > $OUT/ferrox-$q-admin-stats.json
  kill -INT $SRV; wait $SRV 2>/dev/null
done
date; uptime
