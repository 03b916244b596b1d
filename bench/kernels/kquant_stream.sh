#!/usr/bin/env bash
# The K-quant one-row products of a Llama-3.2-1B-shaped model (hidden 2048, 32 / 8 heads of
# 64, MLP 8192, vocabulary 128256) streamed from DRAM, tile path against row path and the
# integer paths (one-row design, 16-bit weights), with the
# two cores' DRAM read probe in the same runs (bench/kernels/kquant_stream.cc). Writes the
# output to stdout; docs/benchmarks.md quotes one run (kquant_stream-zen4.txt here).
#   bash bench/kernels/kquant_stream.sh [THREADS [ROUNDS]]
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-2}
rounds=${2:-8}
bin=$(mktemp /tmp/kquant_stream.XXXXXX)
trap 'rm -f "$bin"' EXIT
c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/kquant_stream.cc -o "$bin"
uptime
# q / o, k / v, gate / up, down (the output head [2048 -> 128256] is q / o's row length: each
# of its products takes ~50 ms, too long for a time slice on a shared machine)
for shape in "2048 2048" "2048 512" "2048 8192" "8192 2048"; do
  "$bin" "$threads" "$rounds" $shape
done
# 2 and 3 rows (the row path's other sizes), 4 and 8 (the tile's, a c8 decode step's), gate /
# up: the float paths against the two integer designs (block_matmul_k_rowint.inc at more rows,
# block_matmul_k_rows16.inc)
for rows in 2 3 4 8; do "$bin" "$threads" "$rounds" 2048 8192 "$rows"; done
# 9, 12 and 15 rows (a c8 step with a few prompt tokens): the tile, the 16-bit weights in two
# passes, the prompt-chunk path padded to 16 lanes, two whole calls; from L2 on one thread as
# well, where a shared host's preemption spoils fewer samples
for rows in 9 12 15; do "$bin" "$threads" "$rounds" 2048 8192 "$rows"; done
for rows in 9 12 15; do CACHED=1 "$bin" 1 $((rounds * 25)) 2048 512 "$rows"; done
uptime
