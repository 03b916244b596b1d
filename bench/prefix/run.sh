#!/bin/bash
# Side-by-side serving runs for docs/benchmarks.md (prefix caching), one server at a time:
#   bench/prefix/run.sh ferrox   # ferrox, cache on: cold 1,805-token prompt, shared prefix, multi-turn,
#                                # random c8; --no-prefix-caching: shared prefix, multi-turn, random c8;
#                                # --prefill-chunk-idle 512: the cold prompt
#   bench/prefix/run.sh prefix   # shared prefix and multi-turn, cache on then off, then llama.cpp's
#                                # server (default, then --cache True); LLAMA_VENV: its virtualenv
# Results go to results/prefix/*.json (git-ignored; OUT=DIR for elsewhere), tables and server timings to
# $LOG; `python bench/summarize.py` folds each table's files into its bench/prefix/*-summary.json.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/prefix}
mkdir -p $OUT
PY=.venv/bin/python
LOG=${LOG:-/tmp/bench_prefix.log}
FPORT=8393; LPORT=8394
GGUF=$($PY -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
B="$PY -m tools.bench.bench_serving --tokenizer-model default --no-progress"

wait_up() {  # url
  for i in $(seq 1 600); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "$1" || true)
    [ "$code" = "200" ] && return 0
    sleep 1
  done
  echo "server at $1 never came up" >> $LOG; return 1
}
start_ferrox() {  # label, extra flags...
  local label=$1; shift
  echo "== start ferrox $label $(date +%T)" >> $LOG
  local t0=$(date +%s.%N)
  .venv/bin/ferrox serve --host 127.0.0.1 --port $FPORT --model default "$@" > /tmp/bench-ferrox-$label.log 2>&1 &
  SPID=$!
  wait_up http://127.0.0.1:$FPORT/health
  echo "ferrox $label up after $(echo "$(date +%s.%N) - $t0" | bc) s" >> $LOG
}
start_llama() {  # label, extra flags...
  local label=$1; shift
  echo "== start llama.cpp $label $(date +%T)" >> $LOG
  ${LLAMA_VENV:-/tmp/llamacpp-venv}/bin/python -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port $LPORT \
      --n_threads 2 --n_threads_batch 2 --n_ctx 4096 --interrupt_requests False "$@" > /tmp/bench-llama-$label.log 2>&1 &
  SPID=$!
  wait_up http://127.0.0.1:$LPORT/v1/models
}
stop_server() {
  kill $SPID; wait $SPID 2>/dev/null; echo "stopped $(date +%T)" >> $LOG
}
run() {  # name, port, label, args...
  local name=$1 port=$2 label=$3; shift 3
  echo "-- $name $(date +%T)" >> $LOG
  $B --base-url http://127.0.0.1:$port --label "$label" --result-json $OUT/$name.json "$@" >> $LOG 2>&1
}
W1="--workload shared-prefix --prefix-len 1200 --input-len 32 --output-len 16 --num-prefixes 2 --num-requests 8 --max-concurrency 1 --warmup-requests 1"
W2="--workload multi-turn --endpoint chat --prefix-len 200 --input-len 48 --output-len 48 --num-turns 8 --num-requests 2 --max-concurrency 1 --warmup-requests 1"
W3="--input-len 128 --output-len 128 --max-concurrency 8 --num-requests 24 --warmup-requests 2"
W4="--input-len 1805 --output-len 8 --num-requests 3 --max-concurrency 1"

phase=${1:-all}
if [ $phase = all ] || [ $phase = ferrox ]; then
  start_ferrox on
  run ferrox-on-cold1805 $FPORT ferrox $W4
  run ferrox-on-shared $FPORT ferrox $W1
  run ferrox-on-multiturn $FPORT ferrox $W2
  run ferrox-on-random-c8 $FPORT ferrox $W3
  curl -s http://127.0.0.1:$FPORT/admin/stats > $OUT/ferrox-on-admin-stats.json
  stop_server
  start_ferrox off --no-prefix-caching
  run ferrox-off-shared $FPORT ferrox-no-cache $W1
  run ferrox-off-multiturn $FPORT ferrox-no-cache $W2
  run ferrox-off-random-c8 $FPORT ferrox-no-cache $W3
  stop_server
  start_ferrox idle512 --prefill-chunk-idle 512
  run ferrox-idle512-cold1805 $FPORT ferrox-idle512 $W4
  stop_server
fi
if [ $phase = prefix ]; then
  start_ferrox on
  run ferrox-on-shared $FPORT ferrox $W1
  run ferrox-on-multiturn $FPORT ferrox $W2
  curl -s http://127.0.0.1:$FPORT/admin/stats > $OUT/ferrox-on-admin-stats-prefix.json
  stop_server
  start_ferrox off --no-prefix-caching
  run ferrox-off-shared $FPORT ferrox-no-cache $W1
  run ferrox-off-multiturn $FPORT ferrox-no-cache $W2
  stop_server
fi
if [ $phase = all ] || [ $phase = llama ] || [ $phase = prefix ]; then
  start_llama default
  run llamacpp-cold1805 $LPORT llama.cpp $W4
  run llamacpp-shared $LPORT llama.cpp $W1
  run llamacpp-multiturn $LPORT llama.cpp $W2
  stop_server
  start_llama ramcache --cache True
  run llamacpp-cache-shared $LPORT llama.cpp-cache $W1
  run llamacpp-cache-multiturn $LPORT llama.cpp-cache $W2
  stop_server
fi
echo "== done $(date +%T)" >> $LOG
