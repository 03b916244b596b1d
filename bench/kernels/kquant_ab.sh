#!/usr/bin/env bash
# Old against new in one process: builds kquant_ab.cc with the 2-15-row K-quant path of OLD_TREE
# (a checkout of this repository, e.g. /work/main or a `git worktree` of main) and of this tree,
# and runs it with the remaining arguments (THREADS ROUNDS K N ROWS [FORMATS]; CACHED=1 for one
# copy from cache).
#   bash bench/kernels/kquant_ab.sh /tmp/old 1 40 2048 512 8 3       # one thread from L2
#   bash bench/kernels/kquant_ab.sh /tmp/old 2 4 8192 2048 8 3       # two threads through DRAM
set -euo pipefail
old=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/../.."
dir=$(mktemp -d /tmp/kquant_ab.XXXXXX)
trap 'rm -rf "$dir"' EXIT
flags="-O3 -std=c++17 -mf16c -pthread"
c++ $flags -I "$old/models/kernels" -DKQ_SIDE=kq_old -c bench/kernels/kquant_ab_side.cc -o "$dir/old.o"
c++ $flags -I models/kernels -DKQ_SIDE=kq_new -c bench/kernels/kquant_ab_side.cc -o "$dir/new.o"
c++ $flags -I models/kernels bench/kernels/kquant_ab.cc "$dir/old.o" "$dir/new.o" -o "$dir/ab"
"$dir/ab" "$@"
