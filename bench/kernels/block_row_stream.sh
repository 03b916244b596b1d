#!/usr/bin/env bash
# The Q4_0 / Q4_1 / Q8_0 one-row products of a Llama-3.2-1B-shaped model (hidden 2048, 32 / 8
# heads of 64, MLP 8192) streamed from DRAM: the block kernel's tile against the
# alternatives of block_row_paths.inc, with the two cores' DRAM read probe in the same runs
# (bench/kernels/block_row_stream.cc). Writes the output to stdout; docs/benchmarks.md quotes
# one run (block_row_stream-zen4.txt here).
#   bash bench/kernels/block_row_stream.sh [THREADS [ROUNDS]]
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-2}
rounds=${2:-8}
bin=$(mktemp /tmp/block_row_stream.XXXXXX)
trap 'rm -f "$bin"' EXIT
c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_row_stream.cc -o "$bin"
uptime
# q / o, k / v, gate / up, down
for shape in "2048 2048" "2048 512" "2048 8192" "8192 2048"; do
  "$bin" "$threads" "$rounds" $shape
done
# 2 and 3 rows, gate / up
for rows in 2 3; do "$bin" "$threads" "$rounds" 2048 8192 "$rows"; done
# one thread, gate / up; and from cache (one copy of k / v in L2): the compute rate
"$bin" 1 "$rounds" 2048 8192
CACHED=1 "$bin" 1 $((rounds * 4)) 2048 512
uptime
