#!/bin/bash
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results/quant/sbs}  # raw results, git-ignored
mkdir -p $OUT
for chunk in 512; do
  date
  .venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default --quantization w8a8 --prefill-chunk $chunk > $OUT/ferrox-w8a8-chunk$chunk.log 2>&1 &
  SRV=$!
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8383/health > /dev/null && break; sleep 1; done
  date
  .venv/bin/python -m tools.bench.bench_serving --base-url http://127.0.0.1:8383 --label ferrox-w8a8-chunk$chunk --tokenizer-model default \
    --input-len 128 --output-len 128 --max-concurrency 32 --num-requests 128 --warmup-requests 2 \
    --result-json $OUT/ferrox-w8a8-chunk$chunk-c32.json > $OUT/ferrox-w8a8-chunk$chunk-c32.json.log 2>&1
  curl -s http://127.0.0.1:8383/admin/stats > $OUT/ferrox-w8a8-chunk$chunk-admin-stats.json
  kill -INT $SRV; wait $SRV 2>/dev/null
done
date
