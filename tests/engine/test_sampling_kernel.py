"""The sampler's CPU kernel (`models/kernels/sample_rows.cc`) against float64 references:
the raw logits' statistics, the greedy token, the exact top-k / top-p / min-p survivors and
the inverse-CDF draw; and the engine's sampler on it against XLA's path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.request import RowSampling
from ferrox_jax.sampling import sample_checked
from models import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
ONE_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))


@functools.cache
def _kernel():
    return jax.jit(cpu_kernels.sample_rows)


def kernel(raw, logits=None, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, uniform=0.0):
    """The kernel on rows of logits, settings broadcast to every row; numpy outputs."""
    raw = np.asarray(raw, np.float32)
    rows = raw.shape[0]
    col = lambda v, t: np.broadcast_to(np.asarray(v, t), (rows,)).copy()  # noqa: E731
    out = _kernel()(raw, raw if logits is None else np.asarray(logits, np.float32), col(temperature, np.float32),
                    col(top_k, np.int32), col(top_p, np.float32), col(min_p, np.float32), col(uniform, np.float32))
    return [np.asarray(a) for a in out]


def survivors(x, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """bool[V]: the tokens top-k, top-p and min-p keep, from float64 probabilities sorted
    exactly (sampling.py's definitions): top-k keeps what is above the (k+1)-th largest,
    top-p the smallest most-likely-first prefix reaching top_p (with its ties), min-p what
    reaches min_p of the most likely; the most likely always survives."""
    y = np.asarray(x, np.float64) / temperature
    p = np.exp(y - y.max())
    p /= p.sum()
    s = np.sort(p)[::-1]
    keep = np.ones(len(p), bool)
    if 0 < top_k < len(p):
        keep &= p > s[top_k]
    if top_p < 1.0:
        keep &= p >= s[np.argmax(np.cumsum(s) >= top_p)]
    keep &= p >= min_p * p.max()
    return keep if keep.any() else p == p.max()


def reference_draw(x, temperature, keep, u) -> int:
    """The inverse-CDF draw over the survivors in vocabulary order (float64)."""
    y = np.asarray(x, np.float64) / temperature
    kept = np.where(keep, np.exp(y - y.max()), 0.0)
    cdf = np.cumsum(kept)
    return int(np.argmax((cdf >= (1.0 - u) * cdf[-1]) & keep))


@pytest.mark.parametrize("vocab", [37, 1000, 49157])
def test_row_statistics_and_greedy_token_match_float64(vocab):
    rng = np.random.default_rng(vocab)
    raw = (rng.standard_normal((5, vocab)) * 4).astype(np.float32)
    raw[1, [3, vocab - 2]] = raw[1].max() + 1  # a tie for the maximum: the first index wins
    raw[2, -1] = raw[2].max() + 2  # the maximum in the row's tail (past the last 8 floats)
    raw[3] -= 300.0  # far below 0: exp of the shifted values still sums right
    token, row_max, log_sum, finite = kernel(raw)
    np.testing.assert_array_equal(row_max, raw.max(axis=1))
    x = raw.astype(np.float64)
    want = np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1))
    np.testing.assert_allclose(log_sum, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(token, raw.argmax(axis=1))
    assert token[1] == 3 and token[2] == vocab - 1
    assert finite.all()


def test_a_row_with_nan_or_inf_is_flagged_alone_and_its_token_stays_in_range():
    raw = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    raw[1, 17], raw[2, 299] = np.nan, np.inf
    raw[3, :] = np.nan
    for temperature in (0.0, 0.8):
        token, _, _, finite = kernel(raw, temperature=temperature, top_p=0.5, uniform=0.3)
        assert finite.tolist() == [True, False, False, False]
        assert ((token >= 0) & (token < 300)).all()


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0, top_k=7),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_p=0.3),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.02),
    dict(temperature=2.0),
    dict(temperature=0.8, top_p=0.0),  # top_p 0 keeps the most likely token alone
])
def test_draws_follow_the_exact_survivors_in_vocabulary_order(settings):
    """u = 0 draws the last survivor, u just below 1 the first, and every u in between the
    float64 inverse-CDF draw (but where the target falls within rounding of a boundary)."""
    vocab, rows = 4099, 3
    rng = np.random.default_rng(sum(map(hash, map(str, settings.items()))) % 2**32)
    raw = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    us = np.concatenate([[0.0, ONE_BELOW_ONE], rng.random(61)]).astype(np.float32)
    for u in us:
        token = kernel(raw, uniform=u, **settings)[0]
        for r in range(rows):
            keep = survivors(raw[r], **settings)
            ids = np.flatnonzero(keep)
            if u == 0.0:
                assert token[r] == ids[-1]
            elif u == ONE_BELOW_ONE:
                assert token[r] == ids[0]
            want = reference_draw(raw[r], settings["temperature"], keep, float(u))
            if token[r] != want:  # only a target within rounding of the boundary may differ
                y = raw[r].astype(np.float64) / settings["temperature"]
                cdf = np.cumsum(np.where(keep, np.exp(y - y.max()), 0.0))
                target = (1.0 - float(u)) * cdf[-1]
                assert keep[token[r]] and abs(cdf[min(token[r], want)] - target) <= 1e-5 * cdf[-1], \
                    f"row {r} u={u}: drew {token[r]}, float64 draws {want}"


def test_top_k_ties_at_the_boundary_keep_fewer_and_ties_at_the_top_keep_all():
    vocab = 64
    raw = np.full((2, vocab), -2.0, np.float32)
    raw[0, [5, 9, 20]] = [6.0, 5.0, 5.0]  # k = 2: the 2nd and 3rd tie, so only token 5 survives
    raw[1, [4, 30, 31]] = [7.0, 7.0, 7.0]  # k = 1: the top ties, all three survive (the cap)
    drawn = [set(), set()]
    for u in np.linspace(0, 0.999, 200, dtype=np.float32):
        token = kernel(raw, temperature=1.0, top_k=np.array([2, 1]), uniform=u)[0]
        drawn[0].add(int(token[0]))
        drawn[1].add(int(token[1]))
    assert drawn == [{5}, {4, 30, 31}]


def test_masked_tokens_are_never_drawn_at_any_temperature():
    vocab = 2000
    raw = np.random.default_rng(5).standard_normal((2, vocab)).astype(np.float32)
    allowed = np.array([3, 700, 1500])  # not the last token: u = 0 draws the last survivor
    masked = np.full_like(raw, -np.inf)
    masked[:, allowed] = raw[:, allowed]
    for temperature in (0.0, 1.0, 50.0, 1e4):
        for u in np.linspace(0, 0.999, 50, dtype=np.float32):
            token = kernel(raw, masked, temperature=temperature, uniform=u)[0]
            assert set(token.tolist()) <= set(allowed.tolist()), f"T={temperature} u={u}: {token}"


@pytest.mark.parametrize("settings", [
    RowSampling(temperature=0.0, logprobs=3),
    RowSampling(temperature=0.7),
    RowSampling(temperature=0.7, top_p=0.9),
    RowSampling(temperature=1.0, top_k=40, min_p=0.05),
    RowSampling(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, logit_bias=((11, 3.0),)),
])
def test_the_engine_sampler_on_the_kernel_matches_xla_path(settings):
    """Same greedy tokens and logprobs, the same draws but where rounding decides (at most one
    of 96 rows), on 96 rows of a SmolLM2-sized vocabulary (rows shared over threads)."""
    vocab, rows = 49152, 96
    rng = np.random.default_rng(7)
    logits = jnp.asarray((rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
    params = [RowSampling(**{**settings.__dict__, "seed": 100 + i}) for i in range(rows)]
    histories = [tuple(rng.integers(0, vocab, 30).tolist()) for _ in range(rows)]
    batch = jax.device_put(SamplingArrays.build(params, histories, [10] * rows, vocab))
    positions = jnp.arange(rows, dtype=jnp.int32)
    out = {k: [np.asarray(a) for a in jax.jit(functools.partial(sample_checked, cpu_kernel=k))(logits, positions, batch)]
           for k in (False, True)}
    (xt, xlp, xids, xtop, xfin), (kt, klp, kids, ktop, kfin) = out[False], out[True]
    assert xfin.all() and kfin.all()
    same = xt == kt
    assert same.all() if settings.temperature == 0 else same.sum() >= rows - 1, f"{(~same).sum()} rows differ"
    np.testing.assert_allclose(klp[same], xlp[same], atol=2e-5)
    if settings.logprobs:
        np.testing.assert_array_equal(kids, xids)
        np.testing.assert_allclose(ktop, xtop, atol=2e-5)
