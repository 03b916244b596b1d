#!/bin/bash
# ferrox in the default `make serve` mode (--quantization auto -> gguf on the shipped Q4_1
# GGUF) side by side with llama.cpp's server, both up for the whole run, alternating
# rounds (peer, then ferrox) at each concurrency; 128-token prompts and outputs.
# Run from the repository root, in phases, so no benchmark call passes 15 minutes:
#   bash bench/quant/gguf/run.sh start           # both servers up (compiles; cpu-share)
#   /work/bin/cpu-exclusive bash bench/quant/gguf/run.sh round 1   # one round: c1, c8, c32
#   ... round 2, round 3 ...
#   /work/bin/cpu-exclusive bash bench/quant/gguf/run.sh cold 1    # one cold 1,805-token prompt each
#   bash bench/quant/gguf/run.sh stop            # admin stats, both servers down
#   python bench/quant/gguf/summarize.py > bench/quant/DIR/summary.md   # medians over the rounds
# PEER_PY: llama-cpp-python[server]'s python; on an Intel host with AMX the peer runs
# through peer_noamx.py (docs/benchmarks.md, "Start the peer"); OUT=DIR keeps another host's results apart
# (default results/quant/gguf, git-ignored: only the summary is kept in bench/).
set -u
OUT=${OUT:-results/quant/gguf}
mkdir -p $OUT
PEER_PY=${PEER_PY:-/work/llvenv/bin/python}
. bench/serving.sh  # bench, wait_health
PEER=http://127.0.0.1:8384 FERROX=http://127.0.0.1:8383
# requests per round by concurrency: a whole number of batches, small enough that three
# alternating rounds of both servers fit (the peer serves one request at a time)
declare -A REQS=([1]=8 [8]=16 [32]=32)
case $1 in
start)
  GGUF=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
  # the AMX wrapper only where AMX is (elsewhere its repacked buffer types help the peer)
  if grep -q -w amx_tile /proc/cpuinfo; then PEER_MAIN="bench/quant/gguf/peer_noamx.py"; else PEER_MAIN="-m llama_cpp.server"; fi
  nohup $PEER_PY $PEER_MAIN --model "$GGUF" --host 127.0.0.1 --port 8384 \
    --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False > $OUT/peer.log 2>&1 &
  echo $! > $OUT/.peer.pid
  nohup .venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model default > $OUT/ferrox.log 2>&1 &
  echo $! > $OUT/.ferrox.pid
  wait_health $PEER/v1/models || echo "peer did not start"
  for i in $(seq 1 3); do wait_health $FERROX/health && break; done || echo "ferrox did not start"
  lscpu | grep -E "Model name|^CPU\(s\)" > $OUT/cpu.txt
  grep -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $OUT/cpu.txt
  ;;
round)
  r=$2
  date -u; uptime
  for c in 1 8 32; do
    # a seed per round and level: fresh random prompts, so no prefix cache helps either side
    seed=$((1000 * r + 10 * c))
    BENCH_ARGS="--seed $seed" bench $PEER llama.cpp $c ${REQS[$c]} $OUT/llamacpp-c$c-r$r.json
    BENCH_ARGS="--seed $seed" bench $FERROX ferrox-gguf $c ${REQS[$c]} $OUT/ferrox-c$c-r$r.json
  done
  uptime
  ;;
cold)  # one cold 1,805-token prompt per server (random tokens: nothing cached), 8 output tokens
  r=$2
  for s in "$PEER llama.cpp llamacpp" "$FERROX ferrox-gguf ferrox"; do
    set -- $s
    .venv/bin/python -m tools.bench.bench_serving --base-url $1 --label $2 --tokenizer-model default \
      --input-len 1805 --output-len 8 --max-concurrency 1 --num-requests 1 --warmup-requests 0 --seed $((100 + r)) \
      --result-json $OUT/$3-cold-r$r.json > $OUT/$3-cold-r$r.json.log 2>&1
  done
  ;;
stop)
  curl -s $FERROX/admin/stats > $OUT/ferrox-admin-stats.json
  kill $(cat $OUT/.peer.pid); kill -INT $(cat $OUT/.ferrox.pid); rm -f $OUT/.peer.pid $OUT/.ferrox.pid
  ;;
esac
