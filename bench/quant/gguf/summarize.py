"""Medians over the rounds of bench/quant/gguf/run.sh: per server and concurrency, output
tok/s (median and every round), TTFT and TPOT p50; ferrox's ratio to the peer per round
and of the medians. Run: python bench/quant/gguf/summarize.py [DIR] (DIR: run.sh's OUT; default
results/quant/gguf)"""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(sys.argv[1] if len(sys.argv) > 1 else "results/quant/gguf")


def load(server: str, what: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(HERE.glob(f"{server}-{what}-r*.json"))]


def main() -> None:
    print("| concurrency | server | rounds | requests ok / failed | output tok/s, median (rounds) | × peer, median "
          "(per round) | TTFT p50 (ms) | TPOT p50 (ms) | len mismatches |\n|---|---|---|---|---|---|---|---|---|")
    for c in (1, 8, 32):
        peer = [r["output_throughput"] for r in load("llamacpp", f"c{c}")]
        for server in ("llamacpp", "ferrox"):
            runs = load(server, f"c{c}")
            if not runs:
                continue
            tps = [r["output_throughput"] for r in runs]
            ratio = [t / p for t, p in zip(tps, peer)]
            ttft = statistics.median(r["median_ttft_ms"] for r in runs)
            tpot = statistics.median(r["median_tpot_ms"] for r in runs)
            ok = sum(r["completed"] for r in runs)
            bad = sum(r["num_failed"] for r in runs)
            mism = sum(r["num_output_len_mismatch"] for r in runs)
            print(f"| {c} | {server} | {len(runs)} | {ok} / {bad} | {statistics.median(tps):.1f} "
                  f"({', '.join(f'{t:.1f}' for t in tps)}) | {statistics.median(tps) / statistics.median(peer):.2f} "
                  f"({', '.join(f'{x:.2f}' for x in ratio)}) | {ttft:,.0f} | {tpot:.1f} | {mism} |")
    for server in ("llamacpp", "ferrox"):
        cold = [r["median_ttft_ms"] for r in load(server, "cold")]
        if cold:
            print(f"cold 1,805-token prompt, {server}: TTFT {', '.join(f'{t:,.0f}' for t in cold)} ms "
                  f"(median {statistics.median(cold):,.0f})")


if __name__ == "__main__":
    sys.exit(main())
