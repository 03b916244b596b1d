"""Gated DeltaNet's chunked form: a prompt chunk's gated delta rule as matmuls over blocks of tokens.

`models/deltanet.py` runs the gated delta rule token by token (a `lax.scan` of T sequential
[B, Hv, dk, dv] updates). This module computes the same outputs and end state with the
blocked (WY / UT transform) algorithm of DeltaNet's and Gated DeltaNet's papers, as
transformers' `torch_chunk_gated_delta_rule` and FLA's `chunk_gated_delta_rule` do: the T
tokens are cut into n blocks of c (the last padded), everything inside a block is a few
[c, c] and [c, d] products, and only the n block boundaries are sequential.

Inside one block, with S0 the state before it, gamma_t = exp(g_1 + ... + g_t) the decay
from the block's start to token t (the cumulative sum of the log-decays), and u_t the
correction token t writes (S_t = exp(g_t) S_{t-1} + k_t u_t^T):

    u_t  = beta_t (v_t - k_t^T exp(g_t) S_{t-1})
         = beta_t v_t - beta_t gamma_t k_t^T S0 - sum_{j<t} beta_t (k_t . k_j) (gamma_t / gamma_j) u_j

so (I + A) U = V_beta - (K_beta * gamma) S0 with A strictly lower triangular,
A[t, j] = beta_t (k_t . k_j) gamma_t / gamma_j. One unit-lower-triangular solve gives

    U_v = (I + A)^-1 V_beta,   W = (I + A)^-1 (K_beta * gamma),   U = U_v - W S0
    o_t = gamma_t q_t^T S0 + sum_{j<=t} (gamma_t / gamma_j) (q_t . k_j) u_j
    S_c = gamma_c S0 + sum_j (gamma_c / gamma_j) k_j u_j^T              (the next block's S0)

Every ratio gamma_t / gamma_j is formed as exp of a difference of cumulative sums over j <= t
(never above 1: g <= 0), and (I + A)^-1 comes from forward substitution (in 16-token
diagonal blocks, merged by the block formula: `unit_lower_inverse`), not from a power
series: I - A + A^2 - ... cancels huge terms when keys are alike (a strictly lower all-ones
A has a two-diagonal inverse but binomial-sized powers).

Padding. A row's padding tokens (valid False: a shorter row's tail in its segment, the
block padding, a padding row of the null slot) get g = 0, beta = 0 and zero q, k, v
(`mask_padding`): their decay is exp(0) = 1 and the correction they write beta * (...) = 0,
so the state passes them unchanged wherever they sit, and their outputs are 0 (nobody reads
them). The scan reaches the same state by keeping the old one on invalid tokens.

Shapes. The block size is min(chunk, T) (CHUNK_TOKENS by default) for a segment of T tokens per row, and T is
one of the engine's chunk buckets (`ferrox_jax/buckets.py`), so each bucket traces one fixed
layout: no shape beyond the buckets the engine already compiles. `uses_chunked(T)` is the
length rule `models/deltanet.py` follows (a decode segment keeps the one-token update;
docs/benchmarks.md, "Qwen3.5: the chunked DeltaNet prefill", has the measurements behind it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Block size c. Work inside a block grows with c (T * c * d), the sequential steps fall as T / c;
# on a CPU 16 measured fastest at every T from 16 to 2048 (8, 32 and 64 slower; docs/benchmarks.md).
# transformers and FLA use 64, for GPUs; an accelerator may want it larger (not measured).
CHUNK_TOKENS = 16
SOLVE_BLOCK = 16  # diagonal blocks of the triangular solve taken by substitution (`unit_lower_inverse`)
# Segments of at least this many tokens per row take the chunked form: from 16 tokens (the
# smallest chunk bucket) it measured 1.6-2x faster than the scan; at 4-8 tokens the two were
# within the noise. Decode segments keep the one-token update.
CHUNKED_FROM_TOKENS = 16

_HIGHEST = jax.lax.Precision.HIGHEST  # f32 products on every backend (TPU/GPU would round to bf16/tf32)


def uses_chunked(tokens: int) -> bool:
    """Whether a segment of `tokens` tokens per row (static) runs the chunked form."""
    return tokens >= CHUNKED_FROM_TOKENS


def mask_padding(q, k, v, g, beta, valid):
    """Padding tokens get zero q, k, v, g and beta: the state passes them unchanged (module docstring)."""
    tok = valid[:, :, None]
    return (jnp.where(tok[..., None], q, 0.0), jnp.where(tok[..., None], k, 0.0), jnp.where(tok[..., None], v, 0.0),
            jnp.where(tok, g, 0.0), jnp.where(tok, beta, 0.0))


def cumulative_decay(g: jax.Array) -> jax.Array:
    """log gamma: the log-decay from a block's start to each of its tokens. g: f32[..., c]."""
    return jnp.cumsum(g, axis=-1)


def _substitute(a: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower triangular A f32[..., s, s], row by row (forward
    substitution): row i is e_i - A[i, :] @ inv, whose rows j < i are final and whose
    rows j >= i meet A[i, j] = 0."""
    s = a.shape[-1]
    eye = jnp.eye(s, dtype=a.dtype)

    def row(i, inv):
        new = eye[i] - _einsum("...j,...jk->...k", jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False), inv)
        return jax.lax.dynamic_update_index_in_dim(inv, new, i, axis=-2)

    return jax.lax.fori_loop(1, s, row, jnp.broadcast_to(eye, a.shape))


def unit_lower_inverse(a: jax.Array, base: int = SOLVE_BLOCK) -> jax.Array:
    """(I + A)^-1 for strictly lower triangular A f32[..., c, c], blocked: the diagonal
    base x base blocks by forward substitution (all at once), then pairs of blocks merged,
    [[L11, 0], [L21, L22]]^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]], doubling the
    block until it covers c (padded up to base * 2^k with zeros: identity rows). A loop of
    base - 1 steps and a few matmuls, where a batched LAPACK trsm on the CPU took 50x a
    matmul of the same operands (measured: 595 against 12 ms for 256 blocks of 64)."""
    c = a.shape[-1]
    size = base
    while size < c:
        size *= 2
    lead = a.shape[:-2]
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)])
    m = size // base
    blocks = a.reshape(*lead, m, base, m, base)
    inv = _substitute(jnp.stack([blocks[..., i, :, i, :] for i in range(m)], axis=-3))  # [..., m, base, base]
    s = base
    while m > 1:
        merged = []
        for j in range(m // 2):
            i11, i22 = inv[..., 2 * j, :, :], inv[..., 2 * j + 1, :, :]
            lo, hi = 2 * j * s, (2 * j + 1) * s
            a21 = a[..., hi:hi + s, lo:lo + s]
            i21 = -_einsum("...ij,...jk->...ik", _einsum("...ij,...jk->...ik", i22, a21), i11)
            top = jnp.concatenate([i11, jnp.zeros_like(i11)], axis=-1)
            merged.append(jnp.concatenate([top, jnp.concatenate([i21, i22], axis=-1)], axis=-2))
        inv, m, s = jnp.stack(merged, axis=-3), m // 2, 2 * s
    return inv[..., 0, :c, :c]


def _einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST)


def _blocks(x: jax.Array, n: int, c: int) -> jax.Array:
    """[B, T, H, ...] -> [n, B, H, c, ...] (zero-padded to n * c tokens): block-major for the scan."""
    pad = n * c - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], n, c, *x.shape[2:])  # [B, n, c, H, ...]
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)  # [n, B, H, c, ...]


def chunked_gated_delta_rule(q, k, v, g, beta, state0, valid, chunk: int = CHUNK_TOKENS):
    """The gated delta rule over T tokens, batched over B rows, in blocks of min(chunk, T).

    Same contract as `models/deltanet.py:gated_delta_rule`:

    Args:
      q, k: f32[B, T, Hv, dk] (l2-normed, q scaled); v: f32[B, T, Hv, dv];
      g, beta: f32[B, T, Hv]; state0: f32[B, Hv, dk, dv]; valid: bool[B, T].
    Returns:
      (o f32[B, T, Hv, dv] (0 on padding), the state after each row's last valid token).
    """
    b, t = q.shape[:2]
    dv = v.shape[-1]
    c = min(chunk, t)
    n = -(-t // c)
    q, k, v, g, beta = mask_padding(q, k, v, g, beta, valid)
    q, k, v = (_blocks(x, n, c) for x in (q, k, v))  # [n, B, H, c, d]
    g, beta = _blocks(g, n, c), _blocks(beta, n, c)  # [n, B, H, c]
    log_gamma = cumulative_decay(g)  # [n, B, H, c]
    lower = jnp.tril(jnp.ones((c, c), bool))  # j <= t
    strictly = jnp.tril(jnp.ones((c, c), bool), -1)  # j < t
    diff = log_gamma[..., :, None] - log_gamma[..., None, :]  # log(gamma_t / gamma_j), [n, B, H, c, c]
    ratio = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # exp only where <= 0
    a = jnp.where(strictly, beta[..., :, None] * _einsum("...tk,...jk->...tj", k, k) * ratio, 0.0)
    gamma = jnp.exp(log_gamma)[..., None]
    rhs = jnp.concatenate([v * beta[..., None], k * beta[..., None] * gamma], axis=-1)
    solved = _einsum("...tj,...jd->...td", unit_lower_inverse(a), rhs)
    u_v, w = solved[..., :dv], solved[..., dv:]
    attn = jnp.where(lower, _einsum("...tk,...jk->...tj", q, k) * ratio, 0.0)
    q_gamma = q * gamma  # reads S0 decayed to token t
    k_rest = k * jnp.exp(log_gamma[..., -1:] - log_gamma)[..., None]  # decayed from token j to the block's end
    block_decay = jnp.exp(log_gamma[..., -1])[..., None, None]  # [n, B, H, 1, 1]

    def block(state, xs):
        u_v, w, q_gamma, k_rest, attn, decay = xs
        u = u_v - _einsum("bhck,bhkv->bhcv", w, state)
        o = _einsum("bhck,bhkv->bhcv", q_gamma, state) + _einsum("bhtj,bhjv->bhtv", attn, u)
        return state * decay + _einsum("bhck,bhcv->bhkv", k_rest, u), o

    xs = (u_v, w, q_gamma, k_rest, attn, block_decay)
    if n == 1:  # one block: no loop around it
        state, o = block(state0, tuple(x[0] for x in xs))
        o = o[None]
    else:
        state, o = jax.lax.scan(block, state0, xs)
    o = o.transpose(1, 0, 3, 2, 4).reshape(b, n * c, -1, dv)  # [n, B, H, c, dv] -> [B, n * c, H, dv]
    return o[:, :t], state
