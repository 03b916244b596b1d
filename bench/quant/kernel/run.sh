#!/bin/bash
# Side by side, one run: llama.cpp's server (llama-cpp-python 0.3.36, 2 threads) vs ferrox
# float32 (decode attention on the CPU kernel, the default), w8a8 all on XLA (the previous
# path: --int8-kernel xla --attention-impl jax), w8a8 on the CPU kernels (the default for
# w8a8), and that with a bfloat16 KV cache; concurrency 1 and 32, 128-token prompts and
# outputs.
# Run from the repository root: bash bench/quant/kernel/run.sh
set -u
OUT=${OUT:-results/quant/kernel}  # raw results, git-ignored
mkdir -p $OUT
PEER_PY=${PEER_PY:-/tmp/llamacpp-venv/bin/python}  # pip install 'llama-cpp-python[server]==0.3.36'
. bench/serving.sh  # bench, wait_health, run_peer
date; uptime; grep -m1 "model name" /proc/cpuinfo
run_peer $PEER_PY
run_ferrox() { # label, then serve flags
  local label=$1; shift
  date; uptime
  .venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default "$@" > $OUT/ferrox-$label.log 2>&1 &
  local srv=$!
  wait_health http://127.0.0.1:8383/health || echo "ferrox $label did not start"
  bench http://127.0.0.1:8383 ferrox-$label 1 16 $OUT/ferrox-$label-c1.json
  bench http://127.0.0.1:8383 ferrox-$label 32 128 $OUT/ferrox-$label-c32.json
  curl -s http://127.0.0.1:8383/admin/stats > $OUT/ferrox-$label-admin-stats.json
  kill -INT $srv; wait $srv 2>/dev/null
}
run_ferrox none
run_ferrox w8a8-xla --quantization w8a8 --int8-kernel xla --attention-impl jax
run_ferrox w8a8-kernel --quantization w8a8
run_ferrox w8a8-kernel-bf16kv --quantization w8a8 --kv-cache-dtype bfloat16
date; uptime
