#!/usr/bin/env bash
# The Q4_0 / Q4_1 / Q8_0 one-row products of a Llama-3.2-1B-shaped model (hidden 2048, 32 / 8
# heads of 64, MLP 8192) streamed from DRAM: the block kernel's float tile against its integer
# row path (block_matmul_rowint.inc), alternated round by round, with the two cores' DRAM read
# probe in the same runs (bench/kernels/block_rowint_stream.cc); then the default model's
# shapes (SmolLM2-135M: hidden 576, MLP 1536) and one thread from cache (the compute rate).
# Writes the output to stdout; docs/benchmarks.md quotes one run (block_rowint_stream-zen4.txt).
#   bash bench/kernels/block_rowint_stream.sh [THREADS [ROUNDS]]
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-2}
rounds=${2:-8}
bin=$(mktemp /tmp/block_rowint_stream.XXXXXX)
trap 'rm -f "$bin"' EXIT
c++ -O3 -std=c++17 -mf16c -pthread -I models/kernels bench/kernels/block_rowint_stream.cc -o "$bin"
uptime
# q / o, k / v, gate / up, down
for shape in "2048 2048" "2048 512" "2048 8192" "8192 2048"; do
  "$bin" "$threads" "$rounds" $shape
done
# the default model's gate / up and down, through DRAM
for shape in "576 1536" "1536 576"; do "$bin" "$threads" "$rounds" $shape; done
# one thread from cache: the paths' compute rate (1B k / v; the default model's gate / up)
CACHED=1 "$bin" 1 $((rounds * 4)) 2048 512
CACHED=1 "$bin" 1 $((rounds * 4)) 576 1536
uptime
