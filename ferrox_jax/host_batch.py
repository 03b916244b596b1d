"""The host batch: one step's inputs as numpy arrays and ints only. No jax here.

The owner thread turns the scheduler's plan into a `HostBatch`, the runner pads it to a
compiled shape and runs it, and the arrays it fetches back become each row's `RowResult`:

    plan = scheduler.schedule()                     StepPlan: rows, by id (ferrox_jax/plan.py)
    batch = HostBatch.build(plan, geometry)         numpy, exact sizes, nothing live
    pending = runner.forward(batch)                 pad -> block copies -> dispatch the forward
    arrays = runner.sample(pending, bitmask)        the masks filled meanwhile -> sample -> fetch
    out = step_output(plan, batch, arrays)          RowResult per row (ferrox_jax/step_output.py)

Because a batch holds nothing but arrays, it can be logged, replayed in a test, or sent to
the other processes of a multi-host mesh as bytes (`to_bytes` / `from_bytes`, lossless).

Layout: R rows in plan order (decode rows, then prompt chunks), N new tokens.

    row_ids         i64[R]        the scheduler's row ids
    token_ids       i32[N]        every row's new tokens, row r's at row_starts[r]:row_starts[r+1]
    positions       i32[N]        their positions
    row_starts      i32[R + 1]    offsets into token_ids (row_starts[0] = 0, row_starts[R] = N)
    block_tables    i32[R, MB]    each row's blocks in position order, 0 past its last
    num_logits      i32[R]        positions the row samples after: 0, 1 (its last new token), or
                                  1 + d for a decoding row with d draft tokens (after every token)
    prompt_logprobs bool[R]       also score each new token given what precedes it (echo)
    next_token_ids  i32[N]        the prompt token after each position, -1 when unknown
    pooling         bool[R]       also return the row's pooled final hidden states (embeddings)
    constrained     bool[R]       the row's output is constrained: its bitmask row is filled
    sampling        SamplingArrays, [R] leaves (penalties sparse: [R, P])
    bitmask         i32[R, W] or None   allowed tokens per row (W = ceil(V / 32)): a recorded
                                  step may carry it (the bytes keep it); the owner loop fills
                                  the step's mask while the forward runs and hands it to
                                  `Runner.sample` directly, leaving this None
    block_copies    i32[C, 2]     (src, dst) block copies that run before the forward
    adapter_slots   i32[R]        each row's LoRA slot (0: no adapter; models/lora.py)
    state_slots     i32[R]        each row's recurrent state slot (0: none; ferrox_jax/state_pool.py)
    image_embeds    f32[N, D] or None   an image's soft-token embedding where image_mask is set
    image_mask      bool[N] or None     (None: no row of the step holds an image)
    attend_until    i32[N] or None      the furthest key each token sees (its position, or its
                                  image's last: `ferrox_jax/images.py`)
    rope_positions  i32[N, 3] or None   M-RoPE positions (Qwen2.5-VL: `ferrox_jax/images.py`);
                                  None: no row of the step has them (each position, three times)
    kv_saves        i32[S, 2]     (device block, host slot): the host tier's saves, run first
    kv_restores     i32[L, 2]     (host slot, device block): its restores, run next (then the
                                  block copies); both None or empty without `--kv-offload-gib`
    window_tables   i32[R, MB] or None  a model whose sliding-window layers keep their own pool
                                  (`ferrox_jax/kv_groups.py`): each row's slot per block of its
                                  table, 0 behind its window (None: no such pool)
    window_copies   i32[C', 2] or None  (src, dst) slot copies, run with the block copies
    state_copies    i32[C'', 2] or None (src, dst) recurrent state slot copies, run in order with
                                  the block copies (snapshot saves, hit restores, n > 1 forks:
                                  `ferrox_jax/state_pool.py`; -1 - h: the host tier's
                                  snapshot slot h); None or empty: none

A new capability adds a column here (an adapter index per row, 1 + k logits per row), not a
branch in the runner.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrox_jax.images import image_columns, rope_columns
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import RowSampling

# Distinct tokens per row that penalties and logit_bias can touch (llama.cpp's default
# window is 64 tokens; OpenAI caps logit_bias at 300 entries).
MAX_PENALTY_TOKENS = 512
ALL_TOKENS_ALLOWED = np.int32(-1)  # a bitmask word with every bit set
_MAGIC = b"FXHB1\n"


def bitmask_words(vocab_size: int) -> int:
    """Words in one bitmask row for `vocab_size` logits: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling inputs (numpy leaves on the host; `ferrox_jax/sampling.py` registers
    the class as a pytree, so the same class carries jax arrays on the device).
    B rows; P = MAX_PENALTY_TOKENS."""

    temperature: Any  # f32[B]; 0 = greedy
    top_k: Any  # i32[B]; 0 = off
    top_p: Any  # f32[B]; 1 = off
    min_p: Any  # f32[B]; 0 = off
    seed: Any  # u32[B]
    penalty_ids: Any  # i32[B, P]; V (out of range) = unused slot
    penalty_add: Any  # f32[B, P]; logit_bias - presence - frequency * count
    penalty_rep: Any  # bool[B, P]; token seen in prompt or output (repetition)
    repetition_penalty: Any  # f32[B]; 1 = off
    want_logprobs: Any  # bool[B]; top-20 logprobs are computed only if some row asks

    @classmethod
    def build(cls, params: Sequence[RowSampling | None], histories: Sequence[tuple[int, ...]],
              num_prompt_tokens: Sequence[int], vocab_size: int) -> "SamplingArrays":
        """One row per entry of `params` (None: a row that samples nothing, greedy defaults).
        `histories[r]` (prompt + output so far) is read only for rows with penalties."""
        rows = len(params)
        arrays = cls.padding(rows, vocab_size)
        for i, p in enumerate(params):
            if p is None:
                continue
            arrays.temperature[i] = p.temperature
            arrays.top_k[i] = p.top_k if p.top_k < vocab_size else 0  # keeping the whole vocabulary is off
            arrays.top_p[i] = p.top_p
            arrays.min_p[i] = p.min_p
            arrays.seed[i] = p.seed & 0xFFFFFFFF
            arrays.repetition_penalty[i] = p.repetition_penalty
            arrays.want_logprobs[i] = p.logprobs is not None
            if p.has_penalties:
                arrays._fill_penalties(i, p, histories[i], num_prompt_tokens[i], vocab_size)
        return arrays

    @classmethod
    def padding(cls, rows: int, vocab_size: int) -> "SamplingArrays":
        """`rows` rows of greedy defaults (no filters, no penalties, no logprobs)."""
        return cls(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                   top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                   seed=np.zeros(rows, np.uint32),
                   penalty_ids=np.full((rows, MAX_PENALTY_TOKENS), vocab_size, np.int32),
                   penalty_add=np.zeros((rows, MAX_PENALTY_TOKENS), np.float32),
                   penalty_rep=np.zeros((rows, MAX_PENALTY_TOKENS), bool),
                   repetition_penalty=np.ones(rows, np.float32), want_logprobs=np.zeros(rows, bool))

    def gather(self, order: np.ndarray, vocab_size: int) -> "SamplingArrays":
        """Row `order[j]` in row j, greedy padding where `order[j]` is -1 (i64[B']).

        The rows already in order and filling the bucket (one stream on a one-row shape,
        a full batch) are these arrays themselves, not a copy: the copy's ten new arrays
        were ~0.2 ms of the owner thread's CPU a step."""
        if len(order) == len(self.temperature) and np.array_equal(order, np.arange(len(order))):
            return self
        out = SamplingArrays.padding(len(order), vocab_size)
        real = order >= 0
        for field in dataclasses.fields(self):
            getattr(out, field.name)[real] = getattr(self, field.name)[order[real]]
        return out

    def _fill_penalties(self, i: int, p: RowSampling, history: tuple[int, ...], num_prompt: int,
                        vocab_size: int) -> None:
        add: dict[int, float] = {}
        rep: set[int] = set()
        generated = history[num_prompt:]
        if p.presence_penalty or p.frequency_penalty:
            ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
            for t, c in zip(ids.tolist(), counts.tolist()):
                add[t] = add.get(t, 0.0) - p.presence_penalty - p.frequency_penalty * c
        if p.repetition_penalty != 1.0:
            rep = set(history)
        for t, b in p.logit_bias:
            add[t] = add.get(t, 0.0) + b
        # Most recent tokens first, so a very long history keeps the newest within the cap.
        order = list(dict.fromkeys([t for t, _ in p.logit_bias] + list(reversed(history))))
        order = [t for t in order if t in add or t in rep][:MAX_PENALTY_TOKENS]
        for j, t in enumerate(order):
            if 0 <= t < vocab_size:
                self.penalty_ids[i, j] = t
                self.penalty_add[i, j] = add.get(t, 0.0)
                self.penalty_rep[i, j] = t in rep


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """What building a batch needs to know about the device side (`ModelRunner.geometry`)."""

    block_size: int  # token positions per KV block
    table_width: int  # blocks per row in every block table (the context ceiling, rounded up)
    vocab_size: int  # the model's logits width V
    image_width: int = 0  # hidden size of a model taking images (its soft tokens' width); 0: none
    mrope: bool = False  # the model's rotary positions are 3-D (M-RoPE): every step carries them
    windowed: bool = False  # the sliding-window layers keep their own pool: batches carry window tables

    def blocks_needed(self, row: RowPlan) -> int:
        """Blocks the row's positions reach. Raises ValueError when its table is too short
        or the positions pass the context ceiling."""
        end = row.start_pos + len(row.token_ids)  # positions start_pos .. end - 1
        needed = -(-end // self.block_size)
        if needed > len(row.block_ids):
            raise ValueError(f"row {row.row_id}: block table has {len(row.block_ids)} blocks but positions "
                             f"up to {end - 1} need {needed}")
        if needed > self.table_width:
            raise ValueError(f"row {row.row_id}: position {end - 1} is beyond the context ceiling "
                             f"({self.table_width} blocks of {self.block_size} positions)")
        return needed


@dataclasses.dataclass
class HostBatch:
    """One step's inputs (see the module docstring for every field's shape)."""

    row_ids: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    row_starts: np.ndarray
    block_tables: np.ndarray
    num_logits: np.ndarray
    prompt_logprobs: np.ndarray
    next_token_ids: np.ndarray
    pooling: np.ndarray
    constrained: np.ndarray
    sampling: SamplingArrays
    block_copies: np.ndarray
    bitmask: np.ndarray | None = None
    adapter_slots: np.ndarray | None = None  # None reads as all zeros
    state_slots: np.ndarray | None = None  # None reads as all zeros
    image_embeds: np.ndarray | None = None
    image_mask: np.ndarray | None = None
    attend_until: np.ndarray | None = None
    rope_positions: np.ndarray | None = None
    kv_saves: np.ndarray | None = None  # None reads as no saves
    kv_restores: np.ndarray | None = None  # None reads as no restores
    window_tables: np.ndarray | None = None
    window_copies: np.ndarray | None = None
    state_copies: np.ndarray | None = None

    @classmethod
    def build(cls, plan: StepPlan, geometry: BatchGeometry) -> "HostBatch":
        """The plan's rows (decode, then chunks) as arrays.

        Raises:
          ValueError: a row's block table does not cover its positions, or reaches past
            the table width (the context ceiling).
        """
        rows = plan.decode + plan.chunks
        lengths = [len(row.token_ids) for row in rows]
        row_starts = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(lengths, out=row_starts[1:])
        num_tokens = int(row_starts[-1])
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        next_token_ids = np.full(num_tokens, -1, np.int32)
        tables = np.zeros((len(rows), geometry.table_width), np.int32)
        window_tables = np.zeros_like(tables) if geometry.windowed else None
        slots = dict(plan.window_slots)
        for i, row in enumerate(rows):
            lo, hi = row_starts[i], row_starts[i + 1]
            token_ids[lo:hi] = row.token_ids
            positions[lo:hi] = np.arange(row.start_pos, row.start_pos + lengths[i])
            needed = geometry.blocks_needed(row)
            tables[i, :needed] = row.block_ids[:needed]
            if window_tables is not None:
                window_tables[i, :needed] = [slots.get(block_id, 0) for block_id in row.block_ids[:needed]]
            if row.prompt_logprobs:
                next_token_ids[lo:hi - 1] = row.token_ids[1:]
                next_token_ids[hi - 1] = row.next_token_id
        sampling = SamplingArrays.build([row.sampling if row.sample else None for row in rows],
                                        [row.history_token_ids for row in rows],
                                        [row.num_prompt_tokens for row in rows], geometry.vocab_size)
        copies = np.asarray(plan.block_copies, np.int32).reshape(-1, 2)
        images = image_columns(rows, row_starts, num_tokens, geometry.image_width)
        return cls(row_ids=np.asarray([row.row_id for row in rows], np.int64), token_ids=token_ids,
                   positions=positions, row_starts=row_starts, block_tables=tables,
                   num_logits=np.asarray([int(row.sample) + row.num_draft_tokens for row in rows], np.int32),
                   prompt_logprobs=np.asarray([row.prompt_logprobs for row in rows], bool),
                   next_token_ids=next_token_ids, pooling=np.asarray([row.pooling for row in rows], bool),
                   constrained=np.asarray([row.is_constrained and row.sample for row in rows], bool),
                   sampling=sampling, block_copies=copies,
                   adapter_slots=np.asarray([row.adapter_slot for row in rows], np.int32),
                   state_slots=np.asarray([row.state_slot for row in rows], np.int32),
                   kv_saves=np.asarray(plan.kv_saves, np.int32).reshape(-1, 2),
                   kv_restores=np.asarray(plan.kv_restores, np.int32).reshape(-1, 2),
                   rope_positions=rope_columns(rows, row_starts, positions),
                   window_tables=window_tables,
                   window_copies=np.asarray(plan.window_copies, np.int32).reshape(-1, 2) if geometry.windowed else None,
                   state_copies=np.asarray(plan.state_copies, np.int32).reshape(-1, 2),
                   **dict(zip(("image_embeds", "image_mask", "attend_until"), images or ())))

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)

    @property
    def row_lengths(self) -> np.ndarray:
        """i32[R]: new tokens per row."""
        return np.diff(self.row_starts)

    @property
    def has_constrained_rows(self) -> bool:
        return bool(self.constrained.any())

    @property
    def has_offload(self) -> bool:
        """The step moves blocks between the device cache and the host tier first."""
        return any(a is not None and len(a) for a in (self.kv_saves, self.kv_restores))

    # -- bytes (what another host receives) ----------------------------------------------

    def to_bytes(self) -> bytes:
        """Every array with its dtype and shape, losslessly (`from_bytes` inverts it)."""
        header, chunks, offset = [], [], 0
        for name, array in _flat_arrays(self):
            data = np.ascontiguousarray(array).tobytes()
            header.append([name, array.dtype.str, list(array.shape), offset, len(data)])
            chunks.append(data)
            offset += len(data)
        head = json.dumps(header, separators=(",", ":")).encode()
        return _MAGIC + len(head).to_bytes(8, "little") + head + b"".join(chunks)

    @classmethod
    def from_bytes(cls, data: bytes) -> "HostBatch":
        if not data.startswith(_MAGIC):
            raise ValueError("not a serialized HostBatch (bad magic)")
        at = len(_MAGIC)
        size = int.from_bytes(data[at:at + 8], "little")
        header = json.loads(data[at + 8:at + 8 + size])
        body = memoryview(data)[at + 8 + size:]
        arrays = {name: np.frombuffer(body[offset:offset + nbytes], dtype=np.dtype(dtype)).reshape(shape).copy()
                  for name, dtype, shape, offset, nbytes in header}
        sampling = SamplingArrays(**{f.name: arrays.pop(f"sampling.{f.name}")
                                     for f in dataclasses.fields(SamplingArrays)})
        return cls(sampling=sampling, bitmask=arrays.pop("bitmask", None), **arrays)


def _flat_arrays(batch: HostBatch) -> list[tuple[str, np.ndarray]]:
    out = []
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, SamplingArrays):
            out += [(f"sampling.{f.name}", np.asarray(getattr(value, f.name))) for f in dataclasses.fields(value)]
        elif value is not None:
            out.append((field.name, np.asarray(value)))
    return out


# ---------------------------------------------------------------- what comes back


@dataclasses.dataclass
class StepArrays:
    """What one step's device work returns, fetched to the host, indexed by host-batch row
    (`HostBatch.row_ids`) and token. K = the most positions a row sampled after (1, or
    1 + d for a row verifying d drafts): column j is what was sampled after the row's j-th
    new token, so a plain row reads column 0 and a speculating row its first 1 + d columns,
    one reading for both (`ferrox_jax/step_output.py`). The prompt and pooling arrays are
    None unless some row of the batch asked for them."""

    tokens: np.ndarray  # i32[R, K] sampled tokens (rows with num_logits 0, or columns past it: meaningless)
    logprob: np.ndarray  # f32[R, K] raw logprob of each
    top_ids: np.ndarray  # i32[R, K, 20]
    top_logprobs: np.ndarray  # f32[R, K, 20]
    prompt_logprob: np.ndarray | None = None  # f32[N] logprob of next_token_ids[n] after token n
    prompt_top_ids: np.ndarray | None = None  # i32[N, 20]
    prompt_top_logprobs: np.ndarray | None = None  # f32[N, 20]
    hidden_sum: np.ndarray | None = None  # f32[R, D] final hidden states summed over the row's tokens
    last_hidden: np.ndarray | None = None  # f32[R, D] the state at the row's last token
    # bool[R]: every logit of the row finite (all of a speculating row's); None: not checked.
    finite: np.ndarray | None = None
