#!/bin/bash
# Concurrency 1 again, interleaved: peer, ferrox w8a8 (both kernels), peer, ferrox; the
# peer's speed moves between runs on this VM, so each ferrox round sits next to a peer one.
# Run from the repository root: bash bench/quant/kernel/run-c1-repeat.sh
set -u
OUT=${OUT:-results/quant/kernel/c1-repeat}  # raw results, git-ignored
mkdir -p $OUT
PEER_PY=${PEER_PY:-/tmp/llamacpp-venv/bin/python}
. bench/serving.sh  # bench, wait_health
GGUF=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
$PEER_PY -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port 8384 \
  --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False > $OUT/peer.log 2>&1 &
PEER=$!
wait_health http://127.0.0.1:8384/v1/models || echo "peer did not start"
.venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default --quantization w8a8 > $OUT/ferrox.log 2>&1 &
SRV=$!
wait_health http://127.0.0.1:8383/health || echo "ferrox did not start"
date; uptime
for round in 1 2 3; do
  bench http://127.0.0.1:8384 llama.cpp 1 16 $OUT/llamacpp-c1-r$round.json
  bench http://127.0.0.1:8383 ferrox-w8a8 1 16 $OUT/ferrox-w8a8-c1-r$round.json
done
date; uptime
curl -s http://127.0.0.1:8383/admin/stats > $OUT/ferrox-admin-stats.json
kill $PEER; kill -INT $SRV; wait $PEER $SRV 2>/dev/null
