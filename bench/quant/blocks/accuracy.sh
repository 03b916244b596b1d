#!/bin/bash
# Accuracy of every serving mode against ferrox float32 on 12 prompts (6 raw, 6 chat):
# KL, top-1 and the greedy-match length of a 30-token continuation (tools/compare_logits.py).
# Run from the repository root: bash bench/quant/blocks/accuracy.sh
set -u
OUT=bench/quant/blocks
for mode in gguf w8a8; do
  for kind in raw chat; do
    chat=$([ $kind = chat ] && echo --chat)
    .venv/bin/python -m tools.compare_logits --model default --reference float32 --quantization $mode \
      --prompts-file $OUT/prompts-$kind.json $chat --greedy-tokens 30 --json > $OUT/compare-logits-$mode-$kind.json
  done
done
