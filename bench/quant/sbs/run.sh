#!/bin/bash
# Side-by-side: llama.cpp peer vs ferrox none / w8a8 / int8, concurrency 1 and 32, one run.
set -u
cd /work/main
OUT=bench/quant/sbs  # result files; run from the repository root (the script cds to /work/main: edit)
mkdir -p $OUT
GGUF=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
bench() { # url label c n file
  .venv/bin/python -m tools.bench_serving --base-url $1 --label $2 --tokenizer-model default \
    --input-len 128 --output-len 128 --max-concurrency $3 --num-requests $4 --warmup-requests 2 \
    --result-json $5 > $5.log 2>&1
}
wait_health() {
  for i in $(seq 1 300); do curl -sf $1 > /dev/null && return 0; sleep 1; done; return 1
}
date; uptime
/tmp/llamacpp-venv/bin/python -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port 8384 \
  --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False > $OUT/peer.log 2>&1 &
PEER=$!
wait_health http://127.0.0.1:8384/v1/models || echo "peer did not start"
bench http://127.0.0.1:8384 llama.cpp 1 16 $OUT/llamacpp-c1.json
bench http://127.0.0.1:8384 llama.cpp 32 128 $OUT/llamacpp-c32.json
kill $PEER; wait $PEER 2>/dev/null
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
