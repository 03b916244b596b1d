#!/bin/bash
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results/quant/sbs}  # raw results, git-ignored
mkdir -p $OUT
date; uptime
.venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default --quantization w8a8 --kv-cache-dtype bfloat16 > $OUT/ferrox-w8a8-bf16kv.log 2>&1 &
SRV=$!
for i in $(seq 1 300); do curl -sf http://127.0.0.1:8383/health > /dev/null && break; sleep 1; done
for c in 1 32; do
  if [ $c = 1 ]; then N=16; else N=128; fi
  .venv/bin/python -m tools.bench.bench_serving --base-url http://127.0.0.1:8383 --label ferrox-w8a8-bf16kv --tokenizer-model default \
    --input-len 128 --output-len 128 --max-concurrency $c --num-requests $N --warmup-requests 2 \
    --result-json $OUT/ferrox-w8a8-bf16kv-c$c.json > $OUT/ferrox-w8a8-bf16kv-c$c.json.log 2>&1
done
curl -s http://127.0.0.1:8383/admin/stats > $OUT/ferrox-w8a8-bf16kv-admin-stats.json
kill -INT $SRV; wait $SRV 2>/dev/null
date; uptime
