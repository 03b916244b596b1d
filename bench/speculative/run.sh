#!/bin/bash
# Both llama.cpp peers (plain, prompt lookup), then the side-by-side run; peers killed at the end.
# Run from the repository root under /work/bin/cpu-exclusive; LLAMA_PY: llama-cpp-python[server]'s python.
#   bench/speculative/run.sh --prompts-c1 3 --max-tokens-c1 128
cd "$(dirname "$0")/../.."
mkdir -p results/speculative  # git-ignored; a table's run is copied to bench/speculative/
LLAMA_PY=${LLAMA_PY:-/work/llvenv/bin/python}
LOGS=${LOGS:-/tmp}
GGUF=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
COMMON="--model $GGUF --host 127.0.0.1 --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False"
"$LLAMA_PY" bench/quant/gguf/peer_noamx.py $COMMON --port 8391 > "$LOGS/peer-plain.log" 2>&1 &
P1=$!
"$LLAMA_PY" bench/quant/gguf/peer_noamx.py $COMMON --port 8392 --draft_model prompt-lookup-decoding \
    --draft_model_num_pred_tokens ${LOOKUP_K:-10} > "$LOGS/peer-lookup.log" 2>&1 &
P2=$!
trap "kill $P1 $P2 2>/dev/null" EXIT
for port in 8391 8392; do
  for i in $(seq 60); do curl -sf http://127.0.0.1:$port/v1/models > /dev/null && break; sleep 1; done
done
.venv/bin/python -m tools.bench.bench_speculative --model default --rounds ${ROUNDS:-2} \
    --llamacpp-url http://127.0.0.1:8391 --llamacpp-lookup-url http://127.0.0.1:8392 \
    --result-json results/speculative/default.json "$@"
