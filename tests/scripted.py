"""Test fakes at the edges: a byte-level tokenizer and a scripted runner.

`ScriptedRunner` implements the `Runner` protocol without a model, but keeps a fake paged
KV cache: each step writes its tokens through its block table, and a sampled token is a
function of (row seed, the row's whole history *read back through its block table*). So a
wrong block table, a missed copy, an overwritten shared block or a skipped position
changes the tokens, and comparing against the same job run alone exposes it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from ferrox_jax.plan import RowStep, StepOutput, StepPlan
from ferrox_jax.request import RowResult
from ferrox_jax.request import RowEvent
from ferrox_jax.scheduler import Scheduler

EOS = 256

TokenFn = Callable[[int, tuple[int, ...]], int]


class ByteTokenizer:
    """ids 0..255 are bytes, 256 is eos (a special token), 257.. are multi-byte pieces."""

    eos_token_id = EOS
    bos_token_id = None
    pad_token_id = None

    def __init__(self) -> None:
        self.stop_token_ids = frozenset({EOS})
        self._pieces: dict[int, bytes] = {}
        self._ids_by_piece: dict[bytes, int] = {}

    @property
    def vocab_size(self) -> int:
        return EOS + 1 + len(self._pieces)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def ids(self, *pieces: str | bytes) -> list[int]:
        """One token per piece: a single byte keeps its byte id, longer pieces get new ids."""
        out = []
        for piece in pieces:
            raw = piece.encode("utf-8") if isinstance(piece, str) else piece
            if len(raw) == 1:
                out.append(raw[0])
                continue
            if raw not in self._ids_by_piece:
                token_id = EOS + 1 + len(self._pieces)
                self._pieces[token_id] = raw
                self._ids_by_piece[raw] = token_id
            out.append(self._ids_by_piece[raw])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raw = bytearray()
        for token_id in ids:
            if token_id == EOS:
                if not skip_special_tokens:
                    raw += b"<eos>"
            elif token_id < 256:
                raw.append(token_id)
            else:
                raw += self._pieces[token_id]
        return raw.decode("utf-8", errors="replace")


def letters_token_fn(eos_period: int | None = None) -> TokenFn:
    """Tokens 'a'..'z' from a hash of (seed, history); eos when the hash % eos_period == 0."""

    def token_fn(seed: int, history: tuple[int, ...]) -> int:
        h = hash((seed, history)) & 0x7FFFFFFF  # int tuples hash the same in every run
        if eos_period is not None and h % eos_period == 0:
            return EOS
        return ord("a") + (h >> 8) % 26

    return token_fn


def script_token_fn(scripts: dict[tuple[int, ...], Sequence[int]]) -> TokenFn:
    """Plays back `scripts[prompt]` token by token, for prompts registered in `scripts`."""
    by_prompt = {tuple(prompt): tuple(tokens) for prompt, tokens in scripts.items()}

    def token_fn(seed: int, history: tuple[int, ...]) -> int:
        for prompt, tokens in by_prompt.items():
            if history[:len(prompt)] == prompt and len(history) - len(prompt) < len(tokens):
                return tokens[len(history) - len(prompt)]
        raise AssertionError(f"no script for history {history!r}")

    return token_fn


class ScriptedRunner:
    """A `Runner` with a fake paged cache; records every plan it was given."""

    recompiles_after_warmup = 0

    def __init__(self, *, block_size: int = 4, num_blocks: int = 65, max_rows: int = 8,
                 max_prefill_tokens: int = 512, token_fn: TokenFn | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks  # including the null block 0
        self.max_rows = max_rows
        self.max_prefill_tokens = max_prefill_tokens
        self.token_fn = token_fn or letters_token_fn()
        self.plans: list[StepPlan] = []
        self.fail_when: Callable[[StepPlan], bool] | None = None
        self.gate: threading.Event | None = None  # when set, run() waits for it
        self.entered = threading.Event()  # set when run() is first called
        self.delay_s = 0.0  # sleep per step, to keep long jobs open in threaded tests
        self._cache: dict[int, list[tuple[int, int] | None]] = {}

    def run(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        self.entered.set()
        time.sleep(self.delay_s)
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "scripted runner gate never opened"
        if self.fail_when is not None and self.fail_when(plan):
            raise RuntimeError("scripted runner failure")
        self._check(plan)
        for src, dst in plan.block_copies:
            self._cache[dst] = list(self._block(src))
        results = {}
        for step in plan.prefill + plan.decode:
            self._write(step)
            result = self._result(step)
            if result is not None:
                results[step.row_id] = result
        return StepOutput(results=results, device_s=0.0)

    def _block(self, block_id: int) -> list[tuple[int, int] | None]:
        return self._cache.setdefault(block_id, [None] * self.block_size)

    def _check(self, plan: StepPlan) -> None:
        assert len(plan.prefill) <= 1, "more than one prefill chunk in a step"
        assert len(plan.decode) <= self.max_rows, f"{len(plan.decode)} decode rows > max_rows"
        assert sum(len(s.token_ids) for s in plan.prefill) <= self.max_prefill_tokens
        written: set[tuple[int, int]] = set()
        for step in plan.prefill + plan.decode:
            end = step.start_pos + len(step.token_ids)
            assert len(step.block_ids) * self.block_size >= end, (
                f"row {step.row_id}: block table {step.block_ids} does not cover position {end - 1}")
            assert all(1 <= b < self.num_blocks for b in step.block_ids), (
                f"row {step.row_id}: block table {step.block_ids} has ids outside the cache")
            for pos in range(step.start_pos, end):
                slot = (step.block_ids[pos // self.block_size], pos % self.block_size)
                assert slot not in written, f"two rows write block slot {slot} in one step"
                written.add(slot)
        for src, dst in plan.block_copies:
            assert 1 <= src < self.num_blocks and 1 <= dst < self.num_blocks and src != dst

    def _write(self, step: RowStep) -> None:
        for i, token_id in enumerate(step.token_ids):
            pos = step.start_pos + i
            self._block(step.block_ids[pos // self.block_size])[pos % self.block_size] = (pos, token_id)

    def _read(self, step: RowStep, num_positions: int) -> tuple[int, ...]:
        history = []
        for pos in range(num_positions):
            slot = self._block(step.block_ids[pos // self.block_size])[pos % self.block_size]
            assert slot is not None and slot[0] == pos, (
                f"row {step.row_id}: position {pos} reads {slot} through {step.block_ids}")
            history.append(slot[1])
        return tuple(history)

    def _result(self, step: RowStep) -> RowResult | None:
        prompt_logprobs = ()
        if step.prompt_logprobs:
            # The logprob of the prompt token at position p is -p: easy to check in order.
            last = step.start_pos + len(step.token_ids) - (1 if step.next_token_id == -1 else 0)
            prompt_logprobs = tuple((-float(p), ()) for p in range(step.start_pos + 1, last + 1))
        if not step.sample:
            return RowResult(step.row_id, -1, prompt_logprobs=prompt_logprobs) if step.prompt_logprobs else None
        history = self._read(step, step.start_pos + len(step.token_ids))
        seed = 0 if step.sampling.is_greedy else step.sampling.seed
        token_id = self.token_fn(seed, history)
        logprob = -float(len(history) % 7) / 8
        k = step.sampling.logprobs or 0
        top = tuple((token_id + i, logprob - i) for i in range(k))
        return RowResult(step.row_id, token_id, logprob, top, prompt_logprobs)


@dataclasses.dataclass
class RowOutput:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_events: int = 0
    num_final_events: int = 0
    events: list[RowEvent] = dataclasses.field(default_factory=list)


def collect(outputs: dict[tuple[str, int], RowOutput], events: Sequence[RowEvent]) -> None:
    for event in events:
        out = outputs.setdefault((event.request_id, event.index), RowOutput())
        assert out.num_final_events == 0, f"{event.request_id}/{event.index}: event after its last"
        out.token_ids += event.token_ids
        out.text += event.text
        out.num_events += 1
        out.events.append(event)
        if event.finish_reason is not None:
            out.finish_reason = event.finish_reason
            out.num_final_events += 1


def tick(scheduler: Scheduler, runner: ScriptedRunner,
         outputs: dict[tuple[str, int], RowOutput]) -> StepPlan:
    """One tick as the owner loop does it (a runner failure fails the step)."""
    plan = scheduler.schedule()
    if not plan.is_empty:
        try:
            out = runner.run(plan)
        except RuntimeError as exc:
            scheduler.fail_step(plan, str(exc))
        else:
            scheduler.update(plan, out)
    collect(outputs, scheduler.take_events())
    return plan


def run_until_idle(scheduler: Scheduler, runner: ScriptedRunner,
                   outputs: dict[tuple[str, int], RowOutput] | None = None,
                   max_ticks: int = 10_000) -> dict[tuple[str, int], RowOutput]:
    outputs = {} if outputs is None else outputs
    for _ in range(max_ticks):
        if not scheduler.has_work:
            return outputs
        tick(scheduler, runner, outputs)
    raise AssertionError(f"scheduler still busy after {max_ticks} ticks")
