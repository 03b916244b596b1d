"""Benchmark prompts for tools/bench/bench_serving.py: synthetic prompts of exact token counts, or a dataset.

Synthetic prompts are random sequences of common English words, composed to an exact
token count with the best tokenizer available, in this order:
  1. `--tokenizer-model default|PATH`: our own `models.tokenizer` (the default GGUF's, a
     .gguf file's or an HF folder's), local, so every server gets the same prompts;
  2. the server's tokenize route: ferrox's (and vLLM's) `/v1/tokenize`, or
     llama-cpp-python's `/extras/tokenize`;
  3. the documented fallback, one token per word: an approximation, flagged by
     `TokenCounter.is_exact = False`; bench_serving then reports the prompt lengths the
     server states in `usage.prompt_tokens`, where it sends usage.
A dataset is a JSONL file of `{"prompt": str, "output_len": int}` lines.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

import httpx

# Words that are one token (with their leading space) in most BPE and SentencePiece
# vocabularies; prompt composition measures each one with the real tokenizer anyway.
_WORDS = """the of and to in is was for on are with as by at from that this have not but
had his they were which one you all she there her would their we him been has when who will
more no if out so said what up its about into than them can only other new some could time
these two may then do first any my now such like our over man me even most made after also
did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long get
here between both life being under never day same another know while last might us great old
year off come since against go came right used take three small large open city house water
dog fox quick brown lazy jumps hello today fine thank blocks values keys new requests others
number point home light fire place hand part high face line word best name side air
music table river paper story night field green black white cold warm""".split()


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len_tokens: int | None   # None when unknown (word approximation or dataset without tokenizer)
    output_len_tokens: int          # max_tokens asked
    messages: tuple[dict, ...] | None = None  # chat messages to send instead of `prompt` as the user's
    group: int = 0                  # shared prefix or conversation the request belongs to (bench_workloads.py)
    turn: int = 0                   # multi-turn: turn index; shared-prefix: 0 cold, 1 warm


class TokenCounter:
    """Counts the tokens of a text: locally, through the server, or one per word."""

    def __init__(self, count: Callable[[str], int], source: str, exact: bool) -> None:
        self.count, self.source, self.is_exact = count, source, exact


def make_counter(http: httpx.Client, tokenizer_model: str | None, server_tokenize: bool) -> TokenCounter:
    """The most exact counter available: `tokenizer_model`, the server's (over `http`), else words."""
    if tokenizer_model is not None:
        tok = load_local_tokenizer(tokenizer_model)
        return TokenCounter(lambda text: len(tok.encode(text)), f"local:{tokenizer_model}", True)
    if server_tokenize:
        probes = [("/v1/tokenize", lambda t: {"prompt": t}, lambda r: r["count"]),
                  ("/extras/tokenize", lambda t: {"input": t}, lambda r: len(r["tokens"]))]
        for path, body, read in probes:
            try:
                r = http.post(path, json=body("hello world"))
                if r.status_code == 200 and read(r.json()) > 0:
                    return TokenCounter(lambda text, p=path, b=body, f=read: f(_ok(http.post(p, json=b(text)))),
                                        f"server:{path}", True)
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                continue
    print("bench_serving: no tokenizer available; assuming one token per word "
          "(prompt lengths reported from the server's usage where it sends it)", file=sys.stderr)
    return TokenCounter(lambda text: len(text.split()), "words", False)


def _ok(r: httpx.Response) -> dict:
    r.raise_for_status()
    return r.json()


def load_local_tokenizer(spec: str) -> Any:
    """`models.tokenizer.Tokenizer` of "default" (the shipped GGUF), a .gguf file or an HF folder."""
    from models.loaders.gguf import default_model_path, open_gguf
    from models.tokenizer import Tokenizer

    path = default_model_path() if spec == "default" else spec
    if Path(path).is_dir():
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(open_gguf(path))


def compose_prompt(counter: TokenCounter, word_costs: dict[str, int], target_tokens: int,
                   rng: random.Random, base_tokens: int = 0) -> tuple[str, int]:
    """A random word sequence whose token count is `target_tokens` (or the closest below it).

    Words are drawn at random while their standalone costs fit; the whole text is then
    counted for real and trimmed or topped up a word at a time, because merges across word
    boundaries and a BOS token make the sum of costs only an estimate.
    """
    words = list(word_costs)
    cheapest = min(word_costs.values())
    chosen: list[str] = []
    budget = target_tokens - base_tokens  # base_tokens: what "" counts (a BOS token, say)
    while budget >= cheapest:
        fits = [w for w in rng.sample(words, min(len(words), 32)) if word_costs[w] <= budget]
        if not fits:
            fits = [w for w in words if word_costs[w] <= budget]
        chosen.append(fits[0])
        budget -= word_costs[fits[0]]
    count = counter.count(" ".join(chosen))
    for _ in range(64):  # converge on the real count; rarely more than a step or two
        if count > target_tokens and chosen:
            chosen.pop()
        elif count < target_tokens:
            chosen.append(min(words, key=lambda w: (word_costs[w], rng.random())))
        else:
            break
        new_count = counter.count(" ".join(chosen))
        if new_count > target_tokens >= count:  # topping up overshoots: keep the last fit
            chosen.pop()
            break
        count = new_count
    text = " ".join(chosen)
    return text, counter.count(text)


def synthetic_requests(counter: TokenCounter, num: int, input_len: int, output_len: int, range_ratio: float,
                       seed: int) -> list[BenchRequest]:
    """`num` random prompts of `input_len` (± range_ratio) tokens, each asking `output_len` (±)."""
    rng = random.Random(seed)
    base_tokens = counter.count("")
    word_costs = {w: counter.count(" " + w) - base_tokens for w in dict.fromkeys(_WORDS)}
    word_costs = {w: c for w, c in word_costs.items() if c > 0}
    requests = []
    for _ in range(num):
        in_len = _jitter(input_len, range_ratio, rng)
        out_len = _jitter(output_len, range_ratio, rng)
        text, count = compose_prompt(counter, word_costs, in_len, rng, base_tokens)
        requests.append(BenchRequest(text, count if counter.is_exact else None, out_len))
    return requests


def _jitter(length: int, ratio: float, rng: random.Random) -> int:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(low, high)


def dataset_requests(path: str, counter: TokenCounter | None) -> list[BenchRequest]:
    """JSONL lines `{"prompt": str, "output_len": int}` (blank lines skipped)."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("output_len"), int):
            raise ValueError(f"{path}:{lineno}: want {{'prompt': str, 'output_len': int}}; got {line[:80]!r}")
        count = counter.count(row["prompt"]) if counter is not None and counter.is_exact else None
        requests.append(BenchRequest(row["prompt"], count, row["output_len"]))
    return requests
