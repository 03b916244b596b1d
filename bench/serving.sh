# Helpers of the side-by-side serving scripts (bench/quant/*/run.sh); source it from the
# repository root after setting OUT.
bench() { # url label concurrency requests result-file: one tools/bench/bench_serving.py run
  # (BENCH_ARGS: more flags for it, e.g. --seed)
  .venv/bin/python -m tools.bench.bench_serving --base-url $1 --label $2 --tokenizer-model default \
    --input-len 128 --output-len 128 --max-concurrency $3 --num-requests $4 --warmup-requests 2 \
    --result-json $5 ${BENCH_ARGS:-} > $5.log 2>&1
}
wait_health() { # url: wait up to 300 s for it to answer 200
  for i in $(seq 1 300); do curl -sf $1 > /dev/null && return 0; sleep 1; done; return 1
}
run_peer() { # python-of-llama-cpp-python: llama.cpp's server (2 threads) on the default GGUF,
  # benched at concurrency 1 (16 requests) and 32 (128), then stopped; files in $OUT
  local gguf
  gguf=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
  $1 -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port 8384 \
    --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False > $OUT/peer.log 2>&1 &
  local peer=$!
  wait_health http://127.0.0.1:8384/v1/models || echo "peer did not start"
  bench http://127.0.0.1:8384 llama.cpp 1 16 $OUT/llamacpp-c1.json
  bench http://127.0.0.1:8384 llama.cpp 32 128 $OUT/llamacpp-c32.json
  kill $peer; wait $peer 2>/dev/null
}
