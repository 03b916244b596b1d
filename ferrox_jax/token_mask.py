"""Device side of structured output: apply a per-row packed allowed-token bitmask to logits.

The host fills the bitmask each tick (`ferrox_jax.grammar.GrammarCompiler.fill_bitmask`:
constrained rows from their grammar matchers, every other row all ones); the jitted step
takes it as one more `i32[B, W]` input and calls `apply_token_bitmask` on the logits
before sampling. The shape depends only on the row bucket and V, never on which rows are
constrained, so constraining a row never recompiles.

Layout (shared with `ferrox_jax.grammar`, llguidance and xgrammar): W = ceil(V / 32);
token t is allowed in row b iff bit (t % 32) of bitmask[b, t // 32] is set. Bits past V
in the last word are ignored.

Disallowed tokens get -inf rather than a large finite negative:
  * softmax then gives them exactly 0 at any temperature (a finite -1e9 divided by a
    temperature of 100 is only -1e7: still ~0, but not 0, and not for every dtype),
    so an inverse-CDF draw never lands on one (`sampling._draw` only stops where the
    kept probability is > 0) and greedy's max is an allowed token's;
  * penalties and logit_bias cannot resurrect them (-inf * p and -inf + bias stay -inf).
  The price: a row with no allowed token at all would give NaN probabilities. The host
  never produces one: a finished or failed matcher still allows the stop tokens, and an
  unconstrained row is all ones.
Rows whose mask is all ones come back bit-identical (`where` passes the logit through).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS_PER_WORD = 32


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set the logits of disallowed tokens to -inf.

    Jittable, no data-dependent shapes: one broadcast shift-and-and unpacks the words to
    [B, W, 32] bits, a reshape and slice give [B, V], a `where` selects.

    Args:
      logits: float[B, V] (f32 in the sampler; any float dtype works).
      bitmask: i32[B, W], W = ceil(V / 32); bit i of word j allows token 32*j + i.
    Returns:
      float[B, V], same dtype as `logits`: logits where allowed, -inf elsewhere.
    Raises:
      ValueError (at trace time) when the shapes or dtypes do not fit, naming both sides.
    """
    if logits.ndim != 2 or bitmask.ndim != 2:
        raise ValueError(f"logits and bitmask must be 2-D [B, V] and [B, W]; got {logits.shape} and {bitmask.shape}")
    b, v = logits.shape
    w = -(-v // BITS_PER_WORD)
    if bitmask.shape != (b, w):
        raise ValueError(f"bitmask must be [B, ceil(V/32)] = {(b, w)} for logits {logits.shape}; got {bitmask.shape}")
    if bitmask.dtype != jnp.int32:
        raise ValueError(f"bitmask must be int32; got {bitmask.dtype}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point; got {logits.dtype}")
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    # An arithmetic shift of a negative word fills with ones from the top, but `& 1` only
    # reads the bit shifted down to position 0, so the sign does not matter.
    bits = (bitmask[:, :, None] >> shifts) & 1  # i32[B, W, 32]
    allowed = bits.reshape(b, w * BITS_PER_WORD)[:, :v].astype(bool)  # bool[B, V]
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, logits.dtype))
