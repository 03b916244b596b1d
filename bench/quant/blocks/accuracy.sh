#!/bin/bash
# Accuracy of every serving mode, and of llama.cpp, against ferrox float32 on 12 prompts (6
# raw, 6 chat): KL, top-1 and the greedy-match length of a 30-token continuation
# (tools/parity/compare_logits.py). The float32 reference is made once per prompt set and saved
# (float32-*.npz, not committed: 60 MB); llama.cpp (llama-cpp-python, logits_all) runs on its
# token ids through tools/parity/llamacpp_logits.py and is scored by the same code.
# Run from the repository root: bash bench/quant/blocks/accuracy.sh
# PEER_PY: llama-cpp-python's python (a venv of its own; docs/benchmarks.md); SKIP_PEER=1
# leaves llama.cpp out, MODES="gguf" picks the ferrox modes, OUT=DIR writes the results there
# (default results/quant/blocks, git-ignored; the prompts stay in bench/quant/blocks), and
# `python bench/quant/blocks/summarize.py DIR` prints the table kept beside the run's summary.
set -u
OUT=${OUT:-results/quant/blocks}
mkdir -p $OUT
PROMPTS=bench/quant/blocks
TMP=${TMP_REF:-/tmp/ferrox-accuracy}
PEER_PY=${PEER_PY:-/work/llvenv/bin/python}
MODES=${MODES:-gguf w8a8 w8a8-block32 int8}
mkdir -p $TMP
GGUF=$(.venv/bin/python -c "from models.loaders.gguf import default_model_path; print(default_model_path())")
for kind in raw chat; do
  chat=$([ $kind = chat ] && echo --chat)
  ref=$TMP/float32-$kind.npz
  [ -f $ref ] || .venv/bin/python -m tools.parity.compare_logits --model default --reference float32 \
    --prompts-file $PROMPTS/prompts-$kind.json $chat --greedy-tokens 30 --save-reference $ref --save-only
  for mode in $MODES; do
    .venv/bin/python -m tools.parity.compare_logits --model default --reference-file $ref --quantization $mode \
      --json > $OUT/compare-logits-$mode-$kind.json
  done
  [ -n "${SKIP_PEER:-}" ] && continue
  $PEER_PY -m tools.parity.llamacpp_logits --model "$GGUF" --token-ids-from $ref --out $TMP/llamacpp-$kind.npz
  .venv/bin/python -m tools.parity.compare_logits --reference-file $ref --ours-file $TMP/llamacpp-$kind.npz \
    --json > $OUT/compare-logits-llamacpp-$kind.json
done
