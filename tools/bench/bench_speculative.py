"""Speculative decoding side by side: one engine without, one with `--speculative ngram`, in
one process, rounds alternating, on a copy-heavy workload and on one with nothing to copy.

    python -m tools.bench.bench_speculative --model default --rounds 2 --result-json results/speculative.json

Both engines are warmed up before the first round (the persistent compile cache makes a
second run's warm-up a disk read). Each round runs, for each engine in turn, each workload
at each concurrency: concurrency 1 sends the prompts one after another, concurrency C sends
C prompts at once. Greedy, so the two engines must return the same tokens: the report puts
the count of identical outputs beside every speed, and the acceptance rate (accepted / draft
tokens, from the engine's `spec_decode_*` counters over that run) beside the speculative
engine's figures.

Why a ratio is what it is, from the same runs' counters (BatcherStats):
  free_verification_bound  decode steps without speculation / decode steps with it: the
                           ratio if a verifying step cost what a one-token step does (the
                           drafts the proposer found and the model kept decide it, not the
                           hardware)
  verify_step_cost         concurrency 1: what a step that verifies drafts costs, in one-token
                           steps (each engine's wall time per tick, device and host: 1.0 is
                           free verification, the bandwidth-bound case the method assumes);
                           not stated where under a fifth of the ticks verify (a 1 % noise in
                           the mean tick would move it by 5 % or more)
  The ratio is about bound / (1 + verifying share of ticks x (verify_step_cost - 1)).

Workloads (chat template, the default model's instruct turn; `--workloads` picks, copy and
nothing by default):
  copy     "here is a file, return it with one thing renamed" over small Python files (the
           name occurs twice: the copy breaks twice)
  edit     "here is a file, return it with one line changed" (one break)
  fix      "here is a file with a typo, return it corrected" (the same kind of task; the
           default model copies this file more faithfully than the other two)
  nothing  short stories on given topics: no text to copy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

FILE = '''import math


def {name}(width, height):
    """Area of a {width}-wide rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def diagonal(width, height):
    return math.sqrt(width ** 2 + height ** 2)


if __name__ == "__main__":
    print({name}(3, 4), perimeter(3, 4), diagonal(3, 4))
'''
TOPICS = ["a dragon who learns to bake bread", "a lighthouse keeper and a storm", "a robot that plants trees",
          "two friends lost in a desert", "a cat that becomes mayor", "a train that never stops",
          "the last library on Earth", "a violin made of ice"]


def copy_prompt(i: int) -> str:
    code = FILE.format(name=f"area_{i}", width=i + 2)
    return (f"Here is a Python file:\n```python\n{code}```\nReturn the whole file with the function "
            f"`area_{i}` renamed to `rect_area`, and nothing else.")


def edit_prompt(i: int) -> str:
    code = FILE.format(name=f"area_{i}", width=i + 2)
    return (f"Here is a Python file:\n```python\n{code}```\nReturn the whole file with the line "
            f"`return 2 * (width + height)` changed to `return 2.0 * (width + height)`, and nothing else.")


def nothing_prompt(i: int) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]} (variation {i})."


def fix_prompt(i: int) -> str:
    code = FILE.format(name=f"area_{i}", width=i + 2).replace("perimeter", "perimetre", 1)
    return (f"Here is a Python file with a typo:\n```python\n{code}```\nFix the typo and return the whole "
            f"corrected file in a code block.")


WORKLOADS = {"copy": copy_prompt, "edit": edit_prompt, "fix": fix_prompt, "nothing": nothing_prompt}


@dataclasses.dataclass
class Sample:
    engine: str
    workload: str
    concurrency: int
    round: int
    wall_s: float
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    outputs: list[list[int]]
    decode_steps: int = 0  # the engine's counters over this run (BatcherStats deltas)
    ticks: int = 0
    tick_s: float = 0.0  # device + host seconds of those ticks
    verifying_steps: int = 0  # row-steps that verified drafts (= steps at concurrency 1)


def _run(llm: Any, workload: str, concurrency: int, num_prompts: int, max_tokens: int) -> tuple[float, list]:
    from ferrox_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    convs = [[{"role": "user", "content": WORKLOADS[workload](i)}] for i in range(num_prompts)]
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.chat(c, params, use_tqdm=False)[0] for c in convs]
    else:
        outs = [o for i in range(0, num_prompts, concurrency)
                for o in llm.chat(convs[i:i + concurrency], params, use_tqdm=False)]
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


class LlamaCppPeer:
    """llama.cpp's server (llama-cpp-python) at `url`, driven over its OpenAI chat route at
    concurrency 1, greedy: outputs are compared as texts (its token ids are not returned),
    and its own draft counters are not exposed (acceptance: none)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def run(self, workload: str, num_prompts: int, max_tokens: int) -> tuple[float, list, int]:
        import httpx

        outs, tokens = [], 0
        start = time.perf_counter()
        with httpx.Client(timeout=600) as client:
            for i in range(num_prompts):
                body = {"messages": [{"role": "user", "content": WORKLOADS[workload](i)}], "temperature": 0.0,
                        "max_tokens": max_tokens, "seed": 0}
                reply = client.post(f"{self.url}/v1/chat/completions", json=body).json()
                outs.append(reply["choices"][0]["message"]["content"])
                tokens += reply["usage"]["completion_tokens"]
        return time.perf_counter() - start, outs, tokens


def _measure_peer(peer: LlamaCppPeer, name: str, r: int, args: argparse.Namespace) -> list[Sample]:
    samples = []
    for workload in args.workloads:
        wall_s, outputs, tokens = peer.run(workload, args.prompts_c1, args.max_tokens_c1)
        samples.append(Sample(name, workload, 1, r, wall_s, tokens, 0, 0, outputs))
        print(f"round {r} {name:5s} {workload:7s} c1   {tokens / wall_s:7.1f} tok/s ({tokens} tokens, {wall_s:.1f} s)",
              file=sys.stderr, flush=True)
    return samples


# BatcherStats fields a run's Sample takes as deltas
_COUNTED = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_drafts",
            "decode_steps", "ticks", "device_s", "host_s")
MIN_VERIFYING_SHARE = 0.2  # fewest verifying ticks, as a share of all, for verify_step_cost


def step_costs(off: list[Sample], ngram: list[Sample]) -> dict:
    """The free-verification bound and, at concurrency 1, the cost of a verifying step in
    one-token steps (module docstring), from the two engines' runs of one workload."""
    steps = {e: sum(s.decode_steps for s in v) for e, v in (("off", off), ("ngram", ngram))}
    out = {"off_steps": steps["off"], "ngram_steps": steps["ngram"],
           "free_verification_bound": round(steps["off"] / steps["ngram"], 3) if steps["ngram"] else None,
           "verify_step_cost": None}
    ticks = sum(s.ticks for s in ngram)
    verifying = sum(s.verifying_steps for s in ngram)
    # Derived from the mean tick, so noise in it is multiplied by ticks / verifying: only
    # stated where at least MIN_VERIFYING_SHARE of the ticks verify.
    if off[0].concurrency == 1 and ticks and verifying >= MIN_VERIFYING_SHARE * ticks and all(s.ticks for s in off):
        per_tick = {e: sum(s.tick_s for s in v) / sum(s.ticks for s in v) for e, v in (("off", off), ("ngram", ngram))}
        # ngram's mean tick = off's x (1 + share x (cost - 1)): a tick that verifies costs `cost` plain ones
        out["verify_step_cost"] = round(1 + (per_tick["ngram"] / per_tick["off"] - 1) * ticks / verifying, 2)
    return out


def measure(llms: dict, args: argparse.Namespace, peers: dict | None = None) -> list[Sample]:
    samples = []
    for r in range(args.rounds):
        for name, peer in (peers or {}).items():
            samples += _measure_peer(peer, name, r, args)
        for name, llm in llms.items():
            for workload in args.workloads:
                for c in args.concurrency:
                    before = llm.engine.stats()
                    n, max_tokens = (args.prompts_c1, args.max_tokens_c1) if c == 1 else (c, args.max_tokens)
                    wall_s, outputs = _run(llm, workload, c, n, max_tokens)
                    after = llm.engine.stats()
                    delta = {f: getattr(after, f) - getattr(before, f) for f in _COUNTED}
                    s = Sample(name, workload, c, r, wall_s, sum(map(len, outputs)),
                               delta["spec_decode_num_draft_tokens"], delta["spec_decode_num_accepted_tokens"],
                               outputs, decode_steps=delta["decode_steps"], ticks=delta["ticks"],
                               tick_s=delta["device_s"] + delta["host_s"],
                               verifying_steps=delta["spec_decode_num_drafts"])
                    samples.append(s)
                    print(f"round {r} {name:5s} {workload:7s} c{c:<3d} {s.output_tokens / wall_s:7.1f} tok/s "
                          f"({s.output_tokens} tokens, {wall_s:.1f} s) accepted {s.accepted_tokens}/{s.draft_tokens}",
                          file=sys.stderr, flush=True)
    return samples


def summarize_peers(samples: list[Sample]) -> list[dict]:
    """llama.cpp without and with its prompt lookup, beside ours (concurrency 1)."""
    rows = []
    for workload in WORKLOADS:
        pick = {e: [s for s in samples if (s.engine, s.workload) == (e, workload)] for e in ("llama", "llama-lookup")}
        if not all(pick.values()):
            continue
        rate = {e: sum(s.output_tokens for s in v) / sum(s.wall_s for s in v) for e, v in pick.items()}
        same = sum(a == b for x, y in zip(pick["llama"], pick["llama-lookup"]) for a, b in zip(x.outputs, y.outputs))
        rows.append(dict(workload=workload, concurrency=1, llama_tok_s=round(rate["llama"], 1),
                         llama_lookup_tok_s=round(rate["llama-lookup"], 1),
                         speedup=round(rate["llama-lookup"] / rate["llama"], 3),
                         identical_outputs=f"{same}/{sum(len(x.outputs) for x in pick['llama'])}"))
    return rows


def summarize(samples: list[Sample]) -> list[dict]:
    samples = [s for s in samples if s.engine in ("off", "ngram")]
    rows = []
    for workload in WORKLOADS:
        for c in sorted({s.concurrency for s in samples}):
            pick = {e: [s for s in samples if (s.engine, s.workload, s.concurrency) == (e, workload, c)]
                    for e in ("off", "ngram")}
            if not all(pick.values()):
                continue
            rate = {e: sum(s.output_tokens for s in v) / sum(s.wall_s for s in v) for e, v in pick.items()}
            same = sum(a == b for x, y in zip(pick["off"], pick["ngram"]) for a, b in zip(x.outputs, y.outputs))
            total = sum(len(x.outputs) for x in pick["off"])
            drafts = sum(s.draft_tokens for s in pick["ngram"])
            accepted = sum(s.accepted_tokens for s in pick["ngram"])
            rows.append(dict(workload=workload, concurrency=c, off_tok_s=round(rate["off"], 1),
                             ngram_tok_s=round(rate["ngram"], 1), speedup=round(rate["ngram"] / rate["off"], 3),
                             identical_outputs=f"{same}/{total}", draft_tokens=drafts, accepted_tokens=accepted,
                             acceptance=round(accepted / drafts, 3) if drafts else None,
                             tokens_per_row=round(sum(s.output_tokens for s in pick["ngram"]) / total, 1),
                             **step_costs(pick["off"], pick["ngram"])))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["copy", "nothing"],
                   help="default: copy nothing (edit, fix: measured apart, docs/benchmarks.md)")
    p.add_argument("--prompts-c1", type=int, default=4, help="prompts of each concurrency-1 run")
    p.add_argument("--max-tokens-c1", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens at concurrency > 1")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-speculative-tokens", type=int, default=None,
                   help="adaptive draft length up to this many (default: SpeculativeConfig's; 0: fixed)")
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--speculative-max-rows", type=int, default=4)
    p.add_argument("--max-seqs", type=int, default=32, help="both engines (the serving default)")
    p.add_argument("--llamacpp-url", help="llama.cpp's server without a draft (measured at c1 in the same rounds)")
    p.add_argument("--llamacpp-lookup-url", help="llama.cpp's server with draft_model=prompt-lookup-decoding")
    p.add_argument("--quantization", default="auto", help="both engines (auto: what ferrox serve runs)")
    p.add_argument("--result-json", type=Path)
    args = p.parse_args(argv)

    from ferrox_jax import LLM
    from ferrox_jax.config import SpeculativeConfig

    adaptive = {} if args.max_speculative_tokens is None else {"max_speculative_tokens": args.max_speculative_tokens}
    spec = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                             ngram_max=args.ngram_max, max_rows=args.speculative_max_rows, **adaptive)
    t0 = time.perf_counter()
    llms = {"off": LLM(args.model, max_seqs=args.max_seqs, quantization=args.quantization),
            "ngram": LLM(args.model, max_seqs=args.max_seqs, quantization=args.quantization, speculative=spec)}
    print(f"loaded and warmed both engines in {time.perf_counter() - t0:.1f} s "
          f"(quantization {llms['off'].engine.model_card.quantization})", file=sys.stderr)
    peers = {name: LlamaCppPeer(url) for name, url in (("llama", args.llamacpp_url),
                                                       ("llama-lookup", args.llamacpp_lookup_url)) if url}
    try:
        samples = measure(llms, args, peers)
    finally:
        for llm in llms.values():
            llm.shutdown()
    rows = summarize(samples) + summarize_peers(samples)
    for row in rows:
        print(json.dumps(row))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(
            {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
             "speculative": dataclasses.asdict(spec), "summary": rows,
             "samples": [{k: v for k, v in dataclasses.asdict(s).items() if k != "outputs"} for s in samples]},
            indent=1))


if __name__ == "__main__":
    main()
