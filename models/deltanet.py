"""Gated DeltaNet: the linear-attention layer of Qwen3.5 / Qwen3-Next, over per-row state slots.

A DeltaNet layer keeps no K/V per token. Each row carries two fixed-size states instead:

    conv state       f32[Kc - 1, C]     the last Kc - 1 inputs of the short causal conv1d
                                        (C = 2 * Hk * dk + Hv * dv: q, k and v channels)
    recurrent state  f32[Hv, dk, dv]    the gated delta rule's memory, one matrix per value head

The engine keeps them in a pool of slots (`RecurrentStates`, one conv and one recurrent array
per DeltaNet layer, `[S, ...]`; slot 0 is the null slot padding rows write into); the host side
hands each row a slot for its lifetime (`ferrox_jax/state_pool.py`), and the forward reads
`state_slots` i32[R] per padded row (decode rows, then chunk rows, as the segments list them).

Per token t of a row (transformers' `torch_recurrent_gated_delta_rule`, f32):

    x_conv    = silu(sum_j w[j] * x[t - Kc + 1 + j])       depthwise conv over the row's inputs
    q, k      = l2norm(q), l2norm(k);  q *= dk^-0.5       (q/k heads repeated to the Hv value heads)
    g         = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    S         = S * exp(g)
    S         = S + k (x) ((v - S^T k) * beta)
    o         = S^T q
    out       = out_proj(rms_norm(o) * w_norm * silu(z))   per value head (the gated RMSNorm)

Every row's state is loaded from its slot (or zeros when the row's first token sits at
position 0: a new sequence, or one recomputed after preemption), advanced only on valid
tokens (padding leaves it as it was), and stored back after the row's last token. Two
kernels advance it, chosen per segment by its static tokens per row T
(`deltanet_chunked.uses_chunked`): a decode segment, and a segment of fewer than 16 tokens
a row, takes `gated_delta_rule`, a `lax.scan` over the T token columns batched over the B
rows (T sequential [B, Hv, dk, dv] updates; a decode segment takes its one update without
the scan's loop); every prompt chunk bucket (16 tokens and up) takes
`models/deltanet_chunked.py`, the blocked (WY / UT transform) form of transformers'
`torch_chunk_gated_delta_rule`: matmuls within blocks of 16 tokens, sequential only across
blocks. Both give the same outputs and end state to float32 rounding
(tests/models/test_deltanet_chunked.py); docs/benchmarks.md ("Qwen3.5: the chunked DeltaNet
prefill") has what each costs.

Speculation. A verification step lays a row's last token and its d drafts out as 1 + d
consecutive one-token decode rows of one slot at consecutive positions (`ferrox_jax/padding.py`),
and which of them the scheduler keeps is known only after sampling. So each slot has E = 1 + k
entries (k the most drafts a row verifies; `ferrox_jax/state_pool.py:state_entries`): entry j
holds the states after the j-th token of the row's last step, and the pool's `positions[s]`
the position entry 0 follows. A row starting a step at position p reads entry p - 1 -
positions[s]: after a plain step (or a prompt chunk, whose states go to entry 0) that is 0,
after a verification the entry of its last accepted token, whatever the scheduler accepted
(a stop or a forced token included). No rollback step, no host column, no extra dispatch:
the next forward reads where it should (as vLLM's GDN spec decode reads the state of its
`num_accepted_tokens`; SGLang instead copies an intermediate state into the slot after
verifying). Keeping the states costs E times the pool's memory; re-running the accepted
tokens instead would cost a second pass over them in the next step and need the scheduler
to recompute positions it has already written.

In the forward (`state_rows`, once; `verification_runs`) a decode row continuing the row
before it (same slot, next position) is a run's later token: its conv window is the run's
conv state followed by the run's earlier inputs (`run_windows`, a gather), and its recurrent
state the one after the row before it (`delta_rule_runs`: passes of the one-token update
over the segment, as many as the longest run this step, one when no row verifies). With E =
1 (no speculation) none of this is traced: each row reads and writes its slot.

Per-layer parameters (HF name after `model.layers.{i}.linear_attn.`):

    in_proj_qkv  [D, C]            in_proj_qkv.weight      (q | k | v channels, in that order)
    in_proj_z    [D, Hv*dv]        in_proj_z.weight        the output gate
    in_proj_b    [D, Hv]           in_proj_b.weight        beta (write strength)
    in_proj_a    [D, Hv]           in_proj_a.weight        the decay's input
    conv_weight  [C, 1, Kc]        conv1d.weight           (HF's layout, kept as stored)
    A_log        [Hv]              A_log
    dt_bias      [Hv]              dt_bias
    gate_norm    [dv]              norm.weight             plain weight (not 1 + w)
    out_proj     [Hv*dv, D]        out_proj.weight

Qwen3-Next (`DeltaNetSpec.fused`) stores the first four as two: in_proj_qkvz [D, 2*Hk*dk +
2*Hv*dv] and in_proj_ba [D, 2*Hv], each grouped per k head (`_projections` takes them apart).

Tensor parallelism (`ferrox_jax/sharding.py`) splits the layer by key-head group: a device
holds Hk/M key heads, the Hv/M value heads they serve (value head j serves key head
j // (Hv/Hk), so a device's value heads are those of its key heads), their conv channels and
their part of every slot's states. Every step of the block is per head, so only out_proj's
row-parallel product reduces across devices. The conv's channel axis C is HF's q | k | v,
which M equal parts would cut across; `models/deltanet_groups.py` regroups it on a mesh to
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (in_proj_qkv's columns and conv1d's channels permuted,
`DeltaNetSpec.shards` recording the grouping; the fused form builds the grouped q | k | v from
its per-group projection), so each part holds whole heads. Speculation runs there as on one
device: a slot's entries are rows of the same split pool arrays, the pool's `positions` are
replicated, and what a verification step reads (`state_rows`' entry, `run_windows`' gather
of the run's inputs, `delta_rule_runs`' state of the row before) indexes rows, slots and
entries, never the split head or channel axis, so it stays on each device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import deltanet_chunked
from models.layers import ForwardContext, param, project, project_many


@dataclasses.dataclass(frozen=True)
class DeltaNetSpec:
    """Static shapes of one DeltaNet layer (part of the graphdef)."""

    num_k_heads: int  # Hk: query/key heads
    num_v_heads: int  # Hv: value heads (a multiple of Hk; each k head serves Hv / Hk consecutive ones)
    k_head_dim: int  # dk
    v_head_dim: int  # dv
    conv_kernel: int  # Kc
    norm_eps: float = 1e-6
    # Qwen3-Next's layout: q/k/v/z fused in one projection and b/a in another, grouped by k head
    fused: bool = False
    # Devices the conv channels are grouped for (tensor parallelism, `group_for_devices`): the
    # C axis is laid out [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], each device's heads' channels
    # contiguous, so a split of C in `shards` equal parts gives each device its own heads. 1: HF's q | k | v.
    shards: int = 1

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def split_channels(self, x: jax.Array):
        """x [..., C] in this spec's channel layout -> q, k [..., Hk, dk] and v [..., Hv, dv]."""
        lead, m = x.shape[:-1], self.shards
        q, k, v = jnp.split(x.reshape(*lead, m, self.conv_dim // m),
                            [self.key_dim // m, 2 * self.key_dim // m], axis=-1)
        hk, dk = self.num_k_heads, self.k_head_dim
        return (q.reshape(*lead, hk, dk), k.reshape(*lead, hk, dk),
                v.reshape(*lead, self.num_v_heads, self.v_head_dim))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) shapes of one slot."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.k_head_dim, self.v_head_dim)


@struct.dataclass
class RecurrentStates:
    """The state pool's device arrays: per DeltaNet layer (in layer order) one conv array
    f32[S * E, Kc - 1, C] and one recurrent array f32[S * E, Hv, dk, dv]; S slots, slot 0 the
    null slot, E entries per slot (1 without speculation; module docstring, "Speculation"):
    entry j of slot s is pool row s + j * S, so entry 0 is row s as without speculation.

    `positions` i32[S] (None when E is 1): entry j of slot s holds the states after
    position positions[s] + j."""

    conv: tuple[jax.Array, ...]
    recurrent: tuple[jax.Array, ...]
    positions: jax.Array | None = None

    @property
    def num_slots(self) -> int:
        return self.conv[0].shape[0] // self.entries

    @property
    def entries(self) -> int:
        return 1 if self.positions is None else self.conv[0].shape[0] // self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.conv + self.recurrent)


def state_bytes_per_slot(specs: tuple[DeltaNetSpec, ...]) -> int:
    """Bytes one slot takes across every DeltaNet layer (f32 states)."""
    total = 0
    for spec in specs:
        (kc, c), (h, dk, dv) = spec.state_shapes()
        total += (kc * c + h * dk * dv) * 4
    return total


def create_states(specs: tuple[DeltaNetSpec, ...], num_slots: int, sharding=None, entries: int = 1) -> RecurrentStates:
    """The zeroed pool of `num_slots` slots (slot 0 included) of `entries` entries each (1 +
    the most drafts a row verifies with speculation, else 1), made on the device (`sharding`:
    a RecurrentStates of shardings, `ferrox_jax/sharding.py:RunnerShardings.states`; None: one device)."""
    if num_slots < 2:
        raise ValueError(f"num_slots must be >= 2 (slot 0 is the null slot); got {num_slots}")
    if entries < 1:
        raise ValueError(f"entries must be >= 1; got {entries}")
    rows = num_slots * entries

    @functools.partial(jax.jit, out_shardings=sharding)
    def zeros():
        return RecurrentStates(
            conv=tuple(jnp.zeros((rows, *s.state_shapes()[0]), jnp.float32) for s in specs),
            recurrent=tuple(jnp.zeros((rows, *s.state_shapes()[1]), jnp.float32) for s in specs),
            positions=jnp.zeros(num_slots, jnp.int32) if entries > 1 else None)

    return zeros()


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' / FLA's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def starts_fresh(positions: jax.Array) -> jax.Array:
    """bool[B]: rows whose first token of the segment is position 0 begin with zero states
    (a new sequence, or one recomputed from its start after preemption); the others continue
    from their slot. positions: i32[B, T]."""
    return positions[:, 0] == 0


def initial_states(conv_pool, rec_pool, slots, fresh):
    """Each row's states at its segment's start: its slot's, or zeros where `fresh`."""
    conv = jnp.where(fresh[:, None, None], 0.0, conv_pool[slots])
    rec = jnp.where(fresh[:, None, None, None], 0.0, rec_pool[slots])
    return conv, rec


def causal_conv(x: jax.Array, conv0: jax.Array, weight: jax.Array, num_valid: jax.Array):
    """The depthwise causal conv1d (+ silu) of one segment, continuing each row's conv state.

    Args:
      x: f32[B, T, C] the rows' new inputs (valid tokens first).
      conv0: f32[B, Kc - 1, C] the inputs before them.
      weight: [C, 1, Kc] (HF's layout).
      num_valid: i32[B] valid tokens per row.
    Returns:
      (f32[B, T, C] outputs, f32[B, Kc - 1, C] the last Kc - 1 inputs up to each row's last
      valid token: the next step's conv state).
    """
    kc = weight.shape[-1]
    t = x.shape[1]
    full = jnp.concatenate([conv0, x], axis=1)  # [B, Kc - 1 + T, C]
    w = weight[:, 0, :].astype(jnp.float32)  # [C, Kc]
    out = sum(full[:, j:j + t] * w[:, j] for j in range(kc))
    idx = num_valid[:, None] + jnp.arange(kc - 1)[None, :]  # [B, Kc - 1]
    conv1 = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return jax.nn.silu(out), conv1


def gated_delta_rule(q, k, v, g, beta, state0, valid):
    """The recurrent gated delta rule over T tokens, batched over B rows (module docstring).

    Args:
      q, k: f32[B, T, Hv, dk] (l2-normed, q scaled); v: f32[B, T, Hv, dv];
      g, beta: f32[B, T, Hv]; state0: f32[B, Hv, dk, dv]; valid: bool[B, T].
    Returns:
      (o f32[B, T, Hv, dv], the state after each row's last valid token).
    """

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t, ok = xs
        decayed = state * jnp.exp(g_t)[..., None, None]
        memory = jnp.einsum("bhkv,bhk->bhv", decayed, k_t)
        delta = (v_t - memory) * b_t[..., None]
        new = decayed + k_t[..., :, None] * delta[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", new, q_t)
        return jnp.where(ok[:, None, None, None], new, state), out

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta, valid))
    if q.shape[1] == 1:  # a decode segment: one update, without the loop XLA would build around it
        state, out = step(state0, tuple(a[0] for a in xs))
        return out[:, None], state
    state, out = jax.lax.scan(step, state0, xs)
    return jnp.swapaxes(out, 0, 1), state


@dataclasses.dataclass(frozen=True)
class SegmentRows:
    """Where each row of one segment finds and leaves its states: flat pool rows (`RecurrentStates`)."""

    read: jax.Array  # i32[B] the row holding the states before the row's first token
    write: jax.Array  # i32[B] where the states after its last valid token go
    # Decode segments with speculation: bool[B] rows continuing the row before them (a
    # verification's later tokens) and i32[B] each row's offset in its run; None otherwise.
    follows: jax.Array | None = None
    part: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class StateRows:
    """What every DeltaNet layer of one forward reads from `state_rows` (a bundle while tracing)."""

    segments: tuple[SegmentRows, ...]
    positions: jax.Array | None  # the pool's `positions` after this forward (None: one entry a slot)


def verification_runs(slots: jax.Array, positions: jax.Array, valid: jax.Array):
    """A decode segment's runs: consecutive rows of one slot at consecutive positions are one
    row's last token and drafts (`ferrox_jax/padding.py` lays a verification out so).

    Returns (follows bool[B], part i32[B] the row's offset in its run, length i32[B] its
    run's length)."""
    b = slots.shape[0]
    index = jnp.arange(b)
    joins = ((slots[1:] == slots[:-1]) & (positions[1:] == positions[:-1] + 1) & valid[1:] & valid[:-1]
             & (slots[1:] != 0))  # the null slot's padding rows are never a run
    follows = jnp.concatenate([jnp.zeros(1, bool), joins])
    head = jax.lax.cummax(jnp.where(follows, 0, index))
    part = index - head
    ends = jnp.concatenate([~joins, jnp.ones(1, bool)])
    last = jax.lax.cummin(jnp.where(ends, index, b - 1), reverse=True)
    return follows, part, part[last] + 1


def commit_entries(part: jax.Array, length: jax.Array, last: jax.Array):
    """(entry, base) per row: the entry of its slot its states go to, and the position entry 0
    of the slot follows from now on. Entry j holds the states after the run's j-th token, so
    whichever token of the run the scheduler accepts last, the next step finds the states after
    it (`state_rows`). `last`: the row's last valid position; `length` (unused here): its run's
    length (a test's negative control keeps only the states after the whole run)."""
    del length
    return part, last - part


def state_rows(fwd: ForwardContext, slots: jax.Array, states: RecurrentStates) -> StateRows:
    """Where each padded row of the forward reads and writes its states (module docstring,
    "Speculation"). Without speculation (one entry a slot) both are the row's slot."""
    segments, row = [], 0
    if states.positions is None:
        for seg in fwd.segments:
            seg_slots = slots[row:row + seg.rows]
            row += seg.rows
            segments.append(SegmentRows(read=seg_slots, write=seg_slots))
        return StateRows(tuple(segments), None)
    num_slots, entries = states.positions.shape[0], states.entries
    base, positions = states.positions, states.positions
    for seg in fwd.segments:
        seg_slots = slots[row:row + seg.rows]
        row += seg.rows
        first = seg.positions[:, 0]
        last = first + seg.valid.sum(axis=1) - 1
        follows = part = None
        if seg.tokens == 1:
            follows, part, length = verification_runs(seg_slots, first, seg.valid[:, 0])
            entry, row_base = commit_entries(part, length, last)
            head = first - part
        else:
            entry, row_base, head = jnp.zeros_like(first), last, first
        # The states before the row's first token: those after position head - 1, entry
        # head - 1 - base of its slot (0 for a row that did not verify last step).
        read = jnp.clip(head - 1 - base[seg_slots], 0, entries - 1)
        segments.append(SegmentRows(read=seg_slots + read * num_slots, write=seg_slots + entry * num_slots,
                                    follows=follows, part=part))
        positions = positions.at[seg_slots].set(row_base)
    return StateRows(tuple(segments), positions)


def run_windows(x: jax.Array, conv0: jax.Array, part: jax.Array) -> jax.Array:
    """Each decode row's conv inputs before its token: the last Kc - 1 of its run's conv state
    followed by the run's tokens before it. x: f32[B, C]; conv0: f32[B, Kc - 1, C]; part: i32[B]."""
    kc1, b = conv0.shape[1], x.shape[0]
    cols = []
    for m in range(kc1):
        back = kc1 - m  # this column is the input `back` tokens before the row's own
        from_run = x[jnp.maximum(jnp.arange(b) - back, 0)]
        from_state = jnp.take_along_axis(conv0, jnp.minimum(part + m, kc1 - 1)[:, None, None], axis=1)[:, 0]
        cols.append(jnp.where((part >= back)[:, None], from_run, from_state))
    return jnp.stack(cols, axis=1)


def delta_rule_runs(q, k, v, g, beta, state0, valid, follows, part):
    """The gated delta rule of a decode segment whose runs of rows are one row's consecutive
    tokens (a verification): a row continues from the state after the row before it in its
    run, else from `state0`. One pass per token of the longest run (a `while` of as many
    trips as this step needs: one when no row verifies), each a decode-sized update of every
    row; pass j makes the run's j-th rows exact, the earlier ones recompute what they had.

    Args: q, k f32[B, Hv, dk]; v f32[B, Hv, dv]; g, beta f32[B, Hv]; state0 f32[B, Hv, dk, dv];
      valid, follows bool[B]; part i32[B].
    Returns (o f32[B, Hv, dv], f32[B, Hv, dk, dv] the state after each row's token)."""

    def update(before):
        decayed = before * jnp.exp(g)[..., None, None]
        memory = jnp.einsum("bhkv,bhk->bhv", decayed, k)
        new = decayed + k[..., :, None] * ((v - memory) * beta[..., None])[..., None, :]
        return jnp.where(valid[:, None, None, None], new, before)

    def again(_, after):
        return update(jnp.where(follows[:, None, None, None], jnp.roll(after, 1, axis=0), state0))

    after = jax.lax.fori_loop(0, jnp.max(part), again, update(state0))
    return jnp.einsum("bhkv,bhk->bhv", after, q), after


class GatedDeltaNet:
    """Mix-in for a decoder layer (an `nnx.Module`): the DeltaNet parameters and the block."""

    def init_deltanet(self, spec: DeltaNetSpec, hidden: int, dtype, rngs: nnx.Rngs) -> None:
        self.delta_spec = spec
        if spec.fused:
            self.in_proj_qkvz = param(rngs, (hidden, 2 * spec.key_dim + 2 * spec.value_dim), dtype)
            self.in_proj_ba = param(rngs, (hidden, 2 * spec.num_v_heads), dtype)
        else:
            self.in_proj_qkv = param(rngs, (hidden, spec.conv_dim), dtype)
            self.in_proj_z = param(rngs, (hidden, spec.value_dim), dtype)
            self.in_proj_b = param(rngs, (hidden, spec.num_v_heads), dtype)
            self.in_proj_a = param(rngs, (hidden, spec.num_v_heads), dtype)
        self.conv_weight = param(rngs, (spec.conv_dim, 1, spec.conv_kernel), dtype, scale=0.3)
        self.A_log = nnx.Param(jnp.zeros((spec.num_v_heads,), dtype))
        self.dt_bias = nnx.Param(jnp.ones((spec.num_v_heads,), dtype))
        self.gate_norm = nnx.Param(jnp.ones((spec.v_head_dim,), dtype))
        self.out_proj = param(rngs, (spec.value_dim, hidden), dtype)

    def _projections(self, h: jax.Array):
        """h [N, D] -> (q|k|v channels [N, C], z [N, Hv*dv], b [N, Hv], a [N, Hv]).

        Fused (Qwen3-Next), each k head's group holds its q (dk), k (dk), then the v and z of
        its Hv / Hk value heads; b and a likewise per group. The conv's channels are q of every
        head, then k, then v, so the groups are taken apart here."""
        spec = self.delta_spec
        if not spec.fused:
            return project_many(h, [self.in_proj_qkv.get_value(), self.in_proj_z.get_value(),
                                    self.in_proj_b.get_value(), self.in_proj_a.get_value()])
        n, hk, dk = h.shape[0], spec.num_k_heads, spec.k_head_dim
        r = spec.num_v_heads // hk
        qkvz, ba = project_many(h, [self.in_proj_qkvz.get_value(), self.in_proj_ba.get_value()])
        qkvz = qkvz.reshape(n, hk, 2 * dk + 2 * r * spec.v_head_dim)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * spec.v_head_dim], axis=-1)
        m = spec.shards  # each device's groups' q, k and v together (the conv's channel layout)
        qkv = jnp.concatenate([q.reshape(n, m, -1), k.reshape(n, m, -1), v.reshape(n, m, -1)], axis=-1)
        qkv = qkv.reshape(n, spec.conv_dim)
        ba = ba.reshape(n, hk, 2 * r)
        return qkv, z.reshape(n, -1), ba[..., :r].reshape(n, -1), ba[..., r:].reshape(n, -1)

    def deltanet(self, h: jax.Array, fwd: ForwardContext, conv_pool: jax.Array, rec_pool: jax.Array,
                 rows: StateRows):
        """h [N, D] (already normed) -> (out_proj output [N, D], conv_pool, rec_pool).

        `rows`: where each padded row reads and writes its states (`state_rows`, once a forward)."""
        spec = self.delta_spec
        n = h.shape[0]
        qkv, z, b, a = self._projections(h)
        qkv = qkv.astype(jnp.float32)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        outs = []
        for seg, placed in zip(fwd.segments, rows.segments):
            nrows, t = seg.rows, seg.tokens
            conv0, rec0 = initial_states(conv_pool, rec_pool, placed.read, starts_fresh(seg.positions))
            x = qkv[seg.start:seg.stop].reshape(nrows, t, spec.conv_dim)
            if placed.part is not None:  # a verification's later tokens start from the run's inputs
                conv0 = run_windows(x[:, 0], conv0, placed.part)
            x, conv1 = causal_conv(x, conv0, self.conv_weight[...], seg.valid.sum(axis=1))
            q, k, v = spec.split_channels(x)
            rep = spec.num_v_heads // spec.num_k_heads
            q = jnp.repeat(l2norm(q), rep, axis=2) * (spec.k_head_dim ** -0.5)
            k = jnp.repeat(l2norm(k), rep, axis=2)
            seg_g = g[seg.start:seg.stop].reshape(nrows, t, spec.num_v_heads)
            seg_beta = beta[seg.start:seg.stop].reshape(nrows, t, spec.num_v_heads)
            if placed.part is not None:
                o, rec1 = delta_rule_runs(q[:, 0], k[:, 0], v[:, 0], seg_g[:, 0], seg_beta[:, 0], rec0,
                                          seg.valid[:, 0], placed.follows, placed.part)
                o = o[:, None]
            else:  # a prompt chunk of enough tokens takes the blocked form (`models/deltanet_chunked.py`)
                chunked = deltanet_chunked.uses_chunked(t)
                rule = deltanet_chunked.chunked_gated_delta_rule if chunked else gated_delta_rule
                o, rec1 = rule(q, k, v, seg_g, seg_beta, rec0, seg.valid)
            conv_pool = conv_pool.at[placed.write].set(conv1)
            rec_pool = rec_pool.at[placed.write].set(rec1)
            outs.append(o.reshape(nrows * t, spec.num_v_heads, spec.v_head_dim))
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        # The gated RMSNorm: normed in f32, times the weight in the activations' dtype, times silu(z).
        var = jnp.mean(o * o, axis=-1, keepdims=True)
        normed = self.gate_norm[...] * (o * jax.lax.rsqrt(var + spec.norm_eps)).astype(h.dtype)
        gate = jax.nn.silu(z.reshape(n, spec.num_v_heads, spec.v_head_dim).astype(jnp.float32))
        o = (normed.astype(jnp.float32) * gate).astype(h.dtype).reshape(n, spec.value_dim)
        return project(o, self.out_proj.get_value()), conv_pool, rec_pool
