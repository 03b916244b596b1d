"""Padding: a `HostBatch` laid out in a compiled `StepShape`, and the results mapped back.

What the runner dispatches is a `ForwardBatch` of one of its step shapes
(`ferrox_jax/buckets.py`): a decode segment of one-token rows, then a chunk segment of
prompt chunks. `pad_batch` picks the smallest shape holding the batch and lays its rows
out in it:

    host rows       r0 (decode)   r1 (speculating: last token + 2 drafts)   r2 (chunk of 5)
    padded rows     [r0, r1, r1', r1'', pad ... | r2 pad ... ]   order = [0, 1, 1, 1, -1 ... | 2, -1 ...]

A speculating row (num_logits = 1 + d) becomes 1 + d consecutive one-token decode rows
sharing its block table, at consecutive positions: every token's K/V is written before any
row attends, so the row at position p + j reads the drafts before it (causal verification
through the one-query kernels, with no shape of its own). Padding tokens are invalid and
write into the null block 0; padding rows sample greedily and are dropped. Host work
only (numpy); the runner hands the result to its compiled step.

`fetch_results` is the step's one fetch (the sampler's packed array, and the prompt or
pooled arrays when a row asked), and `unpad_results` maps what it brought back (padded rows)
to host-batch rows (`StepArrays`): each host row from its first padded row, a speculating
row's samples from its consecutive ones, each prompt token from its flat index.
"""

from __future__ import annotations

import jax
import numpy as np

from ferrox_jax.buckets import Buckets, StepShape
from ferrox_jax.host_batch import HostBatch, StepArrays
from ferrox_jax.request import MAX_LOGPROBS
from ferrox_jax.step import SAMPLED_COLUMNS, ForwardBatch, ForwardResult, image_padding


def empty_forward(shape: StepShape, table_width: int, has_lora: bool, image_width: int = 0,
                  mrope: bool = False, windowed: bool = False) -> ForwardBatch:
    """A ForwardBatch of `shape` with numpy leaves, every token padding (`image_width`: the
    hidden size of a model taking images, 0 for none; `mrope`: its M-RoPE position column;
    `windowed`: with window tables)."""
    n, r = shape.num_tokens, shape.num_rows
    segments = [(shape.decode_rows, 1), (shape.chunk_rows, shape.chunk_tokens)]
    segments = [(rows, tokens) for rows, tokens in segments if rows]
    return ForwardBatch(
        tokens=np.zeros(n, np.int32), positions=np.zeros(n, np.int32), valid=np.zeros(n, bool),
        block_tables=tuple(np.zeros((rows, table_width), np.int32) for rows, _ in segments),
        last_index=np.zeros(r, np.int32), next_tokens=np.full(n, -1, np.int32),
        row_of_token=np.full(n, r, np.int32), want_prompt_logprobs=np.asarray(False),
        segment_tokens=tuple(tokens for _, tokens in segments),
        adapter_slots=np.zeros(n, np.int32) if has_lora else None, state_slots=np.zeros(r, np.int32),
        want_every_hidden=np.asarray(False), **image_padding(n, image_width, mrope),
        window_tables=tuple(np.zeros((rows, table_width), np.int32) for rows, _ in segments) if windowed else None)


def pad_batch(batch: HostBatch, buckets: Buckets, table_width: int, has_lora: bool, image_width: int = 0,
              mrope: bool = False, windowed: bool = False) -> tuple[StepShape, np.ndarray, ForwardBatch]:
    """The step shape, `order` (i64[R']: the host row in each padded row, -1 for padding)
    and the padded forward inputs (module docstring)."""
    lengths = batch.row_lengths
    is_decode = (lengths == 1) | (batch.num_logits == lengths)  # one token, or every token sampled
    decode = np.flatnonzero(is_decode)
    chunks = np.flatnonzero(~is_decode)
    # A speculating row takes one decode row per token; `part` is the token's offset in its row.
    decode_order = np.repeat(decode, lengths[decode])
    part = np.arange(len(decode_order)) - np.repeat(np.cumsum(lengths[decode]) - lengths[decode], lengths[decode])
    shape = buckets.shape_for(len(decode_order), lengths[chunks].tolist())
    order = np.full(shape.num_rows, -1, np.int64)
    order[:len(decode_order)] = decode_order
    order[shape.decode_rows:shape.decode_rows + len(chunks)] = chunks
    offsets = np.zeros(shape.num_rows, np.int64)
    offsets[:len(part)] = part
    out = empty_forward(shape, table_width, has_lora, image_width, mrope, windowed)
    starts = _row_token_starts(shape)
    for row in np.flatnonzero(order >= 0):
        host = order[row]
        lo, hi = batch.row_starts[host], batch.row_starts[host + 1]
        if row < shape.decode_rows:  # one token of a decode row, or of a speculating row
            lo, hi = lo + offsets[row], lo + offsets[row] + 1
        start, stop = starts[row], starts[row] + (hi - lo)
        out.tokens[start:stop] = batch.token_ids[lo:hi]
        out.positions[start:stop] = batch.positions[lo:hi]
        if image_width:
            _pad_image_tokens(out, batch, start, stop, lo, hi)
        if out.rope_positions is not None:
            _pad_rope_positions(out, batch, start, stop, lo, hi)
        out.valid[start:stop] = True
        out.next_tokens[start:stop] = batch.next_token_ids[lo:hi]
        out.row_of_token[start:stop] = row
        out.last_index[row] = stop - 1
        # The chunk segment is the last one; the decode segment, when present, the first.
        segment, local = (0, row) if row < shape.decode_rows else (-1, row - shape.decode_rows)
        out.block_tables[segment][local] = batch.block_tables[host]
        if windowed:
            out.window_tables[segment][local] = batch.window_tables[host]
        if batch.state_slots is not None:
            out.state_slots[row] = batch.state_slots[host]
    wants_prompt = bool(batch.prompt_logprobs.any())
    out = out.replace(want_prompt_logprobs=np.asarray(wants_prompt),
                      want_every_hidden=np.asarray(wants_prompt or bool(batch.pooling.any())))
    return shape, order, _pad_adapters(out, batch, order, starts, shape.decode_rows) if has_lora else out


def _pad_image_tokens(out: ForwardBatch, batch: HostBatch, start: int, stop: int, lo: int, hi: int) -> None:
    """A row's tokens' image columns: its embeddings where it holds an image, and each token's
    furthest visible key (its own position unless the step says otherwise)."""
    if batch.attend_until is None:
        out.attend_until[start:stop] = batch.positions[lo:hi]
        return
    out.attend_until[start:stop] = batch.attend_until[lo:hi]
    out.image_mask[start:stop] = batch.image_mask[lo:hi]
    out.image_embeds[start:stop] = batch.image_embeds[lo:hi]


def _pad_rope_positions(out: ForwardBatch, batch: HostBatch, start: int, stop: int, lo: int, hi: int) -> None:
    """A row's tokens' M-RoPE positions: the step's column, or each position three times."""
    rope = batch.positions[lo:hi, None] if batch.rope_positions is None else batch.rope_positions[lo:hi]
    out.rope_positions[start:stop] = rope


def _pad_adapters(out: ForwardBatch, batch: HostBatch, order: np.ndarray, starts: np.ndarray,
                  decode_rows: int) -> ForwardBatch:
    """Each padded token's LoRA slot (padding: 0)."""
    slots = np.zeros(len(out.tokens), np.int32)
    if batch.adapter_slots is not None:
        for row in np.flatnonzero(order >= 0):
            host = order[row]
            # a decode row holds one token (a speculating row's tokens are several such rows)
            length = 1 if row < decode_rows else batch.row_lengths[host]
            slots[starts[row]:starts[row] + length] = batch.adapter_slots[host]
    return out.replace(adapter_slots=slots)


def split_sampled(packed: np.ndarray) -> list[np.ndarray]:
    """The sampler's packed i32[R, SAMPLED_COLUMNS] (`ferrox_jax/step.py:SampleResult`) as
    views: tokens i32[R], logprob f32[R], top ids i32[R, 20], top logprobs f32[R, 20],
    finite bool[R] (a copy)."""
    if packed.shape[-1] != SAMPLED_COLUMNS or packed.dtype != np.int32:
        raise ValueError(f"packed sampler output must be int32[R, {SAMPLED_COLUMNS}]; got "
                         f"{packed.dtype}{list(packed.shape)}")
    k = MAX_LOGPROBS
    return [packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2:2 + k], packed[:, 2 + k:2 + 2 * k].view(np.float32),
            packed[:, 2 + 2 * k] != 0]


def fetch_results(batch: HostBatch, shape: StepShape, order: np.ndarray, forward: ForwardResult,
                  packed: jax.Array) -> StepArrays:
    """The step's one fetch, per host-batch row: the sampler's packed array (`packed`), and
    the forward's prompt logprobs or pooled states when some row of the batch asked."""
    wants_prompt, wants_pooled = bool(batch.prompt_logprobs.any()), bool(batch.pooling.any())
    fetch = [packed]
    if wants_prompt:
        fetch += [forward.prompt_logprob, forward.prompt_top_ids, forward.prompt_top_logprobs]
    if wants_pooled:
        fetch += [forward.hidden_sum, forward.last_hidden]
    if len(fetch) == 1:  # one array: np.asarray, not device_get's tree walk (~0.2 ms a step on cold caches)
        host, rest = np.asarray(packed), []
    else:
        host, *rest = [np.asarray(a) for a in jax.device_get(fetch)]
    return unpad_results(batch, shape, order, [*split_sampled(host), *rest], wants_prompt, wants_pooled)


def unpad_results(batch: HostBatch, shape: StepShape, order: np.ndarray, fetched: list[np.ndarray],
                  wants_prompt: bool, wants_pooled: bool) -> StepArrays:
    """`fetched`, in padded rows: the sampler's tokens, logprob, top ids, top logprobs and
    finite flags (`split_sampled`), then the prompt arrays (when `wants_prompt`) and the
    pooled ones (when `wants_pooled`); returned per host-batch row (and prompt token)."""
    # Host row h starts at padded row padded_row[h] (a speculating row's later tokens follow it).
    padded_row = np.empty(batch.num_rows, np.int64)
    real = np.flatnonzero(order >= 0)
    if len(real) == batch.num_rows and not (wants_prompt or wants_pooled) and batch.num_logits.max(initial=0) <= 1:
        # One padded row per host row, each sampling at most once (no row speculates): plain
        # picks, the general path's result in a few numpy calls (it runs on caches the
        # forward's weight stream has just emptied: ~0.1 ms a step of the one-row step).
        padded_row[order[real]] = real
        return StepArrays(*(a[padded_row][:, None] for a in fetched[:4]), finite=fetched[4][padded_row])
    first = np.ones(len(real), bool)
    first[1:] = order[real][1:] != order[real][:-1]
    padded_row[order[real][first]] = real[first]
    arrays = StepArrays(*_sampled_columns(batch, fetched[:4], padded_row),
                        finite=_host_finite(fetched[4], order, batch.num_rows))
    rest = fetched[5:]
    if wants_prompt:
        token_index = _host_token_index(batch, shape, padded_row)
        arrays.prompt_logprob, arrays.prompt_top_ids, arrays.prompt_top_logprobs = (a[token_index] for a in rest[:3])
        rest = rest[3:]
    if wants_pooled:
        arrays.hidden_sum, arrays.last_hidden = (a[padded_row] for a in rest)
    return arrays


def _sampled_columns(batch: HostBatch, samples: list[np.ndarray], padded_row: np.ndarray) -> list[np.ndarray]:
    """The sampler's arrays per host row and sampled position, [R, K, ...] with K the most
    positions a row sampled after (1 unless a row speculates): a row's positions sit in
    consecutive padded rows; columns past a row's own repeat its first."""
    width = max(1, int(batch.num_logits.max(initial=0)))
    index = padded_row[:, None] + np.arange(width)[None, :]
    index = np.where(np.arange(width)[None, :] < np.maximum(batch.num_logits, 1)[:, None], index, padded_row[:, None])
    return [a[index] for a in samples]


def _host_finite(finite: np.ndarray, order: np.ndarray, num_rows: int) -> np.ndarray:
    """bool[R] per host row from the padded rows' flags: a speculating row's tokens are
    several padded rows, all of which must be finite; padding rows are ignored."""
    out = np.ones(num_rows, bool)
    real = order >= 0
    np.logical_and.at(out, order[real], finite[real])
    return out


def _row_token_starts(shape: StepShape) -> np.ndarray:
    """i64[R]: flat index of each padded row's first token (decode rows, then chunk rows)."""
    decode = np.arange(shape.decode_rows)
    chunks = shape.decode_rows + np.arange(shape.chunk_rows) * shape.chunk_tokens
    return np.concatenate([decode, chunks]).astype(np.int64)


def host_token_index(batch: HostBatch, shape: StepShape, order: np.ndarray) -> np.ndarray:
    """i64[N]: each host-batch token's index in the padded flat tokens of `pad_batch`'s layout
    (the MTP draft reads the target's per-token hidden states through it)."""
    real = np.flatnonzero(order >= 0)
    first = np.ones(len(real), bool)
    first[1:] = order[real][1:] != order[real][:-1]
    padded_row = np.empty(batch.num_rows, np.int64)
    padded_row[order[real][first]] = real[first]
    return _host_token_index(batch, shape, padded_row)


def _host_token_index(batch: HostBatch, shape: StepShape, padded_row: np.ndarray) -> np.ndarray:
    """i64[N]: for each host-batch token, its index in the padded flat tokens."""
    starts = _row_token_starts(shape)[padded_row]
    lengths = batch.row_lengths
    return np.repeat(starts - batch.row_starts[:-1], lengths) + np.arange(len(batch.token_ids))
