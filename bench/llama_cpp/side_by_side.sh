#!/usr/bin/env bash
# ferrox against llama.cpp's own C++ llama-server on one GGUF: both servers up at once, rounds
# alternating which one is benched first, tokens counted from usage on both sides, RSS of both
# read after every round. Run from the repository root:
#
#   bench/llama_cpp/side_by_side.sh GGUF OUT [SLOTS] [CONCURRENCIES] [ROUNDS]
#     GGUF           the model file (e.g. from tools/bench/shape_gguf.py, or the default model)
#     OUT            folder for result JSONs, server logs, rss.jsonl (e.g. results/sbs-1b-q4km)
#     SLOTS          llama-server --parallel and ferrox --max-seqs (default 8)
#     CONCURRENCIES  e.g. "1 8" (default "1 8")
#     ROUNDS         default 3
#   env: LLAMA_BIN (default results/llama-cpp/build/bin, from bench/llama_cpp/build_peer.sh),
#        CTX per slot (default 1024), INPUT_LEN (128), OUTPUT_LEN (64), REQS_PER_CONC (2: requests
#        = max(8, 2 x concurrency)), FERROX_ARGS (more `ferrox serve` flags), THREADS (2),
#        EXTRA_BODY (JSON merged into every request of both, e.g. '{"temperature": 0.7, "top_p": 0.9}';
#        unset: greedy)
# Then: .venv/bin/python bench/llama_cpp/summarize.py OUT
set -u
GGUF=$1; OUT=$2; SLOTS=${3:-8}; CONCS=${4:-"1 8"}; ROUNDS=${5:-3}
LLAMA_BIN=${LLAMA_BIN:-results/llama-cpp/build/bin}
CTX=${CTX:-1024}; INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-64}; THREADS=${THREADS:-2}
mkdir -p "$OUT"
wait_health() { for i in $(seq 1 600); do curl -sf "$1" > /dev/null && return 0; sleep 1; done; return 1; }
rss_kib() { awk '/VmRSS/ {print $2}' /proc/$1/status 2>/dev/null || echo 0; }
uname -a > "$OUT/host.txt"; grep -m1 "model name" /proc/cpuinfo >> "$OUT/host.txt"; nproc >> "$OUT/host.txt"

T0=$(date +%s.%N)
"$LLAMA_BIN/llama-server" -m "$GGUF" -t $THREADS -tb $THREADS -c $((CTX * SLOTS)) -np $SLOTS \
  --host 127.0.0.1 --port 8384 > "$OUT/llama-server.log" 2>&1 &
PEER=$!
wait_health http://127.0.0.1:8384/health || { echo "llama-server did not start"; kill $PEER; exit 1; }
T1=$(date +%s.%N)
.venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model "$GGUF" --max-seqs $SLOTS \
  --max-context $CTX ${FERROX_ARGS:-} > "$OUT/ferrox.log" 2>&1 &
OURS=$!
wait_health http://127.0.0.1:8383/health || { echo "ferrox did not start"; kill $PEER $OURS; exit 1; }
T2=$(date +%s.%N)
echo "{\"startup_s\": {\"llama-server\": $(echo "$T1 - $T0" | bc), \"ferrox\": $(echo "$T2 - $T1" | bc)}}" > "$OUT/startup.json"

bench() { # url label concurrency file
  local n=$(( $3 * ${REQS_PER_CONC:-2} )); [ $n -lt 8 ] && n=8
  .venv/bin/python -m tools.bench.bench_serving --base-url $1 --label $2 --tokenizer-model default \
    --input-len $INPUT_LEN --output-len $OUTPUT_LEN --max-concurrency $3 --num-requests $n \
    --warmup-requests 2 --seed $ROUND ${EXTRA_BODY:+--extra-body "$EXTRA_BODY"} --result-json $4 > $4.log 2>&1
}
for ROUND in $(seq 1 $ROUNDS); do
  for c in $CONCS; do
    if [ $((ROUND % 2)) = 1 ]; then order="peer ours"; else order="ours peer"; fi
    for who in $order; do
      if [ $who = peer ]; then bench http://127.0.0.1:8384 llama-server $c "$OUT/llama-server-c$c-r$ROUND.json"
      else bench http://127.0.0.1:8383 ferrox $c "$OUT/ferrox-c$c-r$ROUND.json"; fi
    done
  done
  echo "{\"round\": $ROUND, \"llama-server_kib\": $(rss_kib $PEER), \"ferrox_kib\": $(rss_kib $OURS)}" >> "$OUT/rss.jsonl"
done
curl -s http://127.0.0.1:8383/admin/stats > "$OUT/ferrox-admin-stats.json"
kill -INT $OURS; kill $PEER; wait $OURS $PEER 2>/dev/null
