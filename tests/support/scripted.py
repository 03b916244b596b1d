"""Test fakes at the edges: a byte-level tokenizer and a scripted runner.

`ScriptedRunner` implements the whole `Runner` protocol (`ferrox_jax/runner_protocol.py`)
without a model, but keeps a fake paged KV cache: each step's `forward` (read from its host
batch, after a round trip through bytes) writes its tokens through its block table, and
`sample` draws each token as a function of (row seed, the row's whole history *read back
through its block table*). So a wrong block table, a missed copy, an overwritten shared
block or a skipped position changes the tokens, and comparing against the same job run
alone exposes it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ferrox_jax.host_batch import BatchGeometry, HostBatch, StepArrays
from ferrox_jax.step_output import run_plan
from ferrox_jax.plan import StepPlan
from ferrox_jax.request import RowEvent
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.speculative import NgramProposer

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


@dataclasses.dataclass
class ScriptedPending:
    """A scripted forward: its tokens are written; `sample` reads them back."""

    batch: HostBatch  # the batch as the runner read it (after its round trip through bytes)

    def is_done(self) -> bool:
        return True


class ScriptedRunner:
    """A `Runner` with a fake paged cache, reading every step from its host batch; records
    each batch it was given (`tick` below also records the plans it runs)."""

    vocab_size = 1024
    max_loras = 0

    def __init__(self, *, block_size: int = 4, num_blocks: int = 65, max_rows: int = 8,
                 max_chunk_tokens: int = 512, max_chunks: int = 1, token_fn: TokenFn | None = None,
                 kv_offload_blocks: int = 0, kv_offload_snapshots: int = 0) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks  # including the null block 0
        self.max_rows = max_rows
        self.max_chunk_tokens = max_chunk_tokens
        self.max_chunks = max_chunks
        self.kv_offload_blocks = kv_offload_blocks  # host tier slots; saved blocks live in `_host`
        self.kv_offload_snapshots = kv_offload_snapshots  # its snapshot slots (states: the tests' oracles)
        self.token_fn = token_fn or letters_token_fn()
        self.geometry = BatchGeometry(block_size, -(-4096 // block_size), self.vocab_size)
        self.plans: list[StepPlan] = []  # filled by `tick` (scheduler-level tests)
        self.batches: list[HostBatch] = []
        self.fail_when: Callable[[HostBatch], bool] | None = None
        self.gate: threading.Event | None = None  # when set, forward() waits for it
        self.entered = threading.Event()  # set when forward() is first called
        self.at_gate = threading.Event()  # set once a forward() waits for the gate
        self.delay_s = 0.0  # sleep per step, to keep long jobs open in threaded tests
        self.bitmasks: list[np.ndarray | None] = []  # what each `sample` was given
        self.is_warm = True
        self.released: list[int] = []  # `release` levels, in order (state verbs are recorded, not run)
        self.num_swaps = 0
        self._sleep_level = 0
        self._cache: dict[int, list[tuple[int, int] | None]] = {}
        self._host: dict[int, list[tuple[int, int] | None]] = {}  # host slot -> a saved block's contents

    # -- the Runner protocol ---------------------------------------------------------------

    @property
    def recompiles_after_warmup(self) -> int:
        return 0

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    def forward(self, batch: HostBatch) -> ScriptedPending:
        self.batches.append(batch)
        self.entered.set()
        time.sleep(self.delay_s)
        if self.gate is not None:
            self.at_gate.set()
            assert self.gate.wait(timeout=30), "scripted runner gate never opened"
        if self.fail_when is not None and self.fail_when(batch):
            raise RuntimeError("scripted runner failure")
        batch = HostBatch.from_bytes(batch.to_bytes())  # what another process would run
        self._check(batch)
        if batch.has_offload:
            self.offload_blocks(batch.kv_saves, batch.kv_restores)
        self.copy_blocks(batch.block_copies)
        for r in range(batch.num_rows):
            self._write(batch, r)
        return ScriptedPending(batch)

    def sample(self, pending: ScriptedPending, bitmask: np.ndarray | None) -> StepArrays:
        batch = pending.batch
        self.bitmasks.append(bitmask)  # recorded, never applied: a script may play a token a grammar forbids
        rows, width = batch.num_rows, max(1, int(batch.num_logits.max(initial=0)))
        arrays = StepArrays(tokens=np.full((rows, width), -1, np.int32), logprob=np.zeros((rows, width), np.float32),
                            top_ids=np.zeros((rows, width, 20), np.int32),
                            top_logprobs=np.zeros((rows, width, 20), np.float32),
                            prompt_logprob=np.zeros(len(batch.token_ids), np.float32),
                            prompt_top_ids=np.zeros((len(batch.token_ids), 20), np.int32),
                            prompt_top_logprobs=np.zeros((len(batch.token_ids), 20), np.float32))
        if batch.pooling.any():
            arrays.hidden_sum, arrays.last_hidden = np.zeros((rows, 2), np.float32), np.zeros((rows, 2), np.float32)
        for r in range(rows):
            self._result(batch, r, arrays)
        return arrays

    def copy_blocks(self, copies: np.ndarray) -> None:
        for src, dst in np.asarray(copies).reshape(-1, 2).tolist():
            self._cache[dst] = list(self._block(src))

    def encode_images(self, pixels: np.ndarray) -> np.ndarray:
        raise ValueError("the scripted runner's model takes no images")

    def offload_blocks(self, saves: np.ndarray, restores: np.ndarray) -> None:
        for block_id, slot in np.asarray(saves).reshape(-1, 2).tolist():
            assert 0 <= slot < self.kv_offload_blocks, f"host slot {slot} outside the tier"
            self._host[slot] = list(self._block(block_id))
        for slot, block_id in np.asarray(restores).reshape(-1, 2).tolist():
            self._cache[block_id] = list(self._host[slot])

    def warmup(self, progress=None, num_threads=None) -> float:
        self.is_warm = True
        return 0.0

    def compile_keys(self) -> list[tuple]:
        return []  # nothing is compiled

    def swap_state(self, update) -> None:
        self.num_swaps += 1  # no weights to update

    def release(self, level: int) -> int:
        if not self._sleep_level:
            self.released.append(level)
            self._sleep_level = level
            self._cache.clear()  # the KV cache is gone
        return self._sleep_level

    def restore(self) -> None:
        self._sleep_level = 0

    # -- the fake cache ----------------------------------------------------------------------

    def _positions(self, batch: HostBatch, r: int) -> range:
        lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
        return range(int(batch.positions[lo]), int(batch.positions[lo]) + int(hi - lo))

    def _table(self, batch: HostBatch, r: int) -> list[int]:
        return [b for b in batch.block_tables[r].tolist() if b != 0]

    def _block(self, block_id: int) -> list[tuple[int, int] | None]:
        return self._cache.setdefault(block_id, [None] * self.block_size)

    def _check(self, batch: HostBatch) -> None:
        lengths = batch.row_lengths
        assert (lengths > 0).all(), "a row with no tokens"
        assert int((batch.num_logits > 0).sum()) <= batch.num_rows
        decode_rows = [r for r in range(batch.num_rows) if lengths[r] == 1]
        chunks = [r for r in range(batch.num_rows) if lengths[r] > 1]
        assert len(chunks) <= self.max_chunks, f"{len(chunks)} chunks in a step > max_chunks {self.max_chunks}"
        assert len(decode_rows) <= self.max_rows + self.max_chunks, f"{len(decode_rows)} one-token rows > max_rows"
        assert all(lengths[r] <= self.max_chunk_tokens for r in chunks)
        written: set[tuple[int, int]] = set()
        for r in range(batch.num_rows):
            table, row_id = self._table(batch, r), int(batch.row_ids[r])
            positions = self._positions(batch, r)
            assert len(table) * self.block_size >= positions.stop, (
                f"row {row_id}: block table {table} does not cover position {positions.stop - 1}")
            assert all(1 <= b < self.num_blocks for b in table), (
                f"row {row_id}: block table {table} has ids outside the cache")
            for pos in positions:
                slot = (table[pos // self.block_size], pos % self.block_size)
                assert slot not in written, f"two rows write block slot {slot} in one step"
                written.add(slot)
        for src, dst in batch.block_copies.tolist():
            assert 1 <= src < self.num_blocks and 1 <= dst < self.num_blocks and src != dst

    def _write(self, batch: HostBatch, r: int) -> None:
        table, lo = self._table(batch, r), int(batch.row_starts[r])
        for i, pos in enumerate(self._positions(batch, r)):
            self._block(table[pos // self.block_size])[pos % self.block_size] = (pos, int(batch.token_ids[lo + i]))

    def _read(self, batch: HostBatch, r: int, num_positions: int) -> tuple[int, ...]:
        table, history = self._table(batch, r), []
        for pos in range(num_positions):
            slot = self._block(table[pos // self.block_size])[pos % self.block_size]
            assert slot is not None and slot[0] == pos, (
                f"row {int(batch.row_ids[r])}: position {pos} reads {slot} through {table}")
            history.append(slot[1])
        return tuple(history)

    def _result(self, batch: HostBatch, r: int, arrays: StepArrays) -> None:
        lo, hi = int(batch.row_starts[r]), int(batch.row_starts[r + 1])
        if batch.prompt_logprobs[r]:
            # The logprob of the prompt token at position p is -p: easy to check in order.
            arrays.prompt_logprob[lo:hi] = [-float(p + 1) for p in self._positions(batch, r)]
        num_logits = int(batch.num_logits[r])
        s = batch.sampling
        seed = 0 if s.temperature[r] == 0 else int(s.seed[r])
        end = self._positions(batch, r).stop
        # Sampled after each of the row's last `num_logits` tokens (a speculating row verifies several).
        for j, stop in enumerate(range(end - num_logits + 1, end + 1)):
            history = self._read(batch, r, stop)
            token_id = self.token_fn(seed, history)
            logprob = -float(len(history) % 7) / 8
            arrays.tokens[r, j], arrays.logprob[r, j] = token_id, logprob
            arrays.top_ids[r, j] = token_id + np.arange(20)
            arrays.top_logprobs[r, j] = logprob - np.arange(20)


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
    if plan.draft_requests:  # prompt lookup's drafts (the scripted runner has no draft model)
        plan = scheduler.add_drafts(plan, NgramProposer(scheduler.limits.speculative).propose(plan))
    if not plan.is_empty:
        runner.plans.append(plan)
        try:
            out = run_plan(runner, plan)
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
