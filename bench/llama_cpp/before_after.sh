#!/usr/bin/env bash
# A change's effect on serving, with the peer beside it: llama-server (port 8384), ferrox from this
# checkout (8383) and ferrox from BEFORE, a worktree of the baseline commit (8385), all three up at
# once, rounds rotating which goes first. Run from the repository root:
#
#   git worktree add /tmp/before BASE && ln -s "$PWD/.venv" /tmp/before/.venv \
#     && (cd /tmp/before && .venv/bin/python -m models.cpu_kernels)
#   BEFORE=/tmp/before bench/llama_cpp/before_after.sh GGUF OUT SLOTS "CONCURRENCIES" ROUNDS
#   .venv/bin/python bench/llama_cpp/summarize.py OUT
#
# env as side_by_side.sh: LLAMA_BIN, CTX, INPUT_LEN, OUTPUT_LEN, EXTRA_BODY.
set -u
GGUF=$1; OUT=$2; SLOTS=$3; CONCS=$4; ROUNDS=$5
BEFORE=${BEFORE:?a worktree of the baseline commit, its kernels built}
LLAMA_BIN=${LLAMA_BIN:-results/llama-cpp/build/bin}
CTX=${CTX:-1024}; INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-64}
mkdir -p "$OUT"; HERE=$PWD; OUT=$(realpath "$OUT"); GGUF=$(realpath "$GGUF")
wait_health() { for i in $(seq 1 600); do curl -sf "$1" > /dev/null && return 0; sleep 1; done; return 1; }
rss_kib() { awk '/VmRSS/ {print $2}' /proc/$1/status 2>/dev/null || echo 0; }
"$LLAMA_BIN/llama-server" -m "$GGUF" -t 2 -tb 2 -c $((CTX * SLOTS)) -np $SLOTS --host 127.0.0.1 --port 8384 > "$OUT/llama-server.log" 2>&1 &
PEER=$!
wait_health http://127.0.0.1:8384/health || exit 1
.venv/bin/ferrox serve --host 127.0.0.1 --port 8383 --model "$GGUF" --max-seqs $SLOTS --max-context $CTX > "$OUT/ferrox.log" 2>&1 &
OURS=$!
wait_health http://127.0.0.1:8383/health || exit 1
(cd "$BEFORE" && PYTHONPATH="$BEFORE" "$HERE/.venv/bin/python" -c "import sys; from api.cli import main; sys.argv[0]='ferrox'; sys.exit(main())" serve --host 127.0.0.1 --port 8385 --model "$GGUF" --max-seqs $SLOTS --max-context $CTX > "$OUT/ferrox-before.log" 2>&1) &
wait_health http://127.0.0.1:8385/health || exit 1
BEFORE_PID=$(pgrep -f "port 8385" | head -1)
bench() { # url label concurrency file
  local n=$(( $3 * 2 )); [ $n -lt 8 ] && n=8
  .venv/bin/python -m tools.bench.bench_serving --base-url $1 --label $2 --tokenizer-model default \
    --input-len $INPUT_LEN --output-len $OUTPUT_LEN --max-concurrency $3 --num-requests $n \
    --warmup-requests 2 --seed $ROUND ${EXTRA_BODY:+--extra-body "$EXTRA_BODY"} --result-json $4 > $4.log 2>&1
}
for ROUND in $(seq 1 $ROUNDS); do
  for c in $CONCS; do
    case $((ROUND % 3)) in 1) order="peer ours before";; 2) order="before peer ours";; 0) order="ours before peer";; esac
    for who in $order; do
      case $who in
        peer) bench http://127.0.0.1:8384 llama-server $c "$OUT/llama-server-c$c-r$ROUND.json";;
        ours) bench http://127.0.0.1:8383 ferrox $c "$OUT/ferrox-c$c-r$ROUND.json";;
        before) bench http://127.0.0.1:8385 ferrox-before $c "$OUT/ferrox-before-c$c-r$ROUND.json";;
      esac
    done
  done
  echo "{\"round\": $ROUND, \"llama-server_kib\": $(rss_kib $PEER), \"ferrox_kib\": $(rss_kib $OURS), \"ferrox-before_kib\": $(rss_kib $BEFORE_PID)}" >> "$OUT/rss.jsonl"
done
kill -INT $OURS $BEFORE_PID; kill $PEER; wait 2>/dev/null
