#!/usr/bin/env bash
# Q4_0 / Q4_1 / Q8_0 products of 2 to 15 rows at a Llama-3.2-1B's shapes: the float path,
# block_matmul_i16.inc's 8-lane row groups and block_matmul_rows16.inc (2 x 4 and 4 x 2 rows x
# columns in the lanes) alternated in every round (bench/kernels/block_rows_stream.cc): two
# threads through DRAM on the gate / up shape with the DRAM probe in the same run, and one
# thread from L2 on k / v. docs/benchmarks.md quotes one run (block_rows_stream-zen4.txt).
#   bash bench/kernels/block_rows_stream.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
bin=$(mktemp /tmp/block_rows_stream.XXXXXX)
trap 'rm -f "$bin"' EXIT
c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_rows_stream.cc -o "$bin"
for rows in 2 4 8 12; do
  uptime
  "$bin" 2 "$rounds" 2048 8192 "$rows"
done
for rows in 2 4 8 12; do
  uptime
  CACHED=1 "$bin" 1 $((rounds * 4)) 2048 512 "$rows"
done
uptime
