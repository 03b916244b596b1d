"""Markdown table of accuracy.sh's compare-logits-*.json: per mode, over the raw and the
chat prompts, the mean KL(float32 || mode), the mean top-1 agreement and the mean greedy
match of the 30-token continuation. Run: python bench/quant/blocks/summarize.py [DIR] (default:
results/quant/blocks, where accuracy.sh writes)"""

import json
import sys
from pathlib import Path

HERE = Path(sys.argv[1] if len(sys.argv) > 1 else "results/quant/blocks")


def main() -> None:
    print("| mode | prompts | mean KL (nats) | max KL | top-1 | greedy match (of 30) |\n|---|---|---|---|---|---|")
    for path in sorted(HERE.glob("compare-logits-*.json")):
        mode, kind = path.stem.removeprefix("compare-logits-").rsplit("-", 1)
        prompts = json.loads(path.read_text())["prompts"]
        n = len(prompts)
        mean_kl = sum(p["mean_kl"] for p in prompts) / n
        max_kl = max(p["max_kl"] for p in prompts)
        top1 = sum(p["top1"] for p in prompts) / n
        greedy = sum(p["greedy_match"] for p in prompts) / n
        print(f"| {mode} | {n} {kind} | {mean_kl:.2g} | {max_kl:.2g} | {top1:.3f} | {greedy:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
