"""On-device sampling: filters keep exactly the right tokens, draws follow the probabilities.
Every test runs on XLA's path and, where the CPU kernels are built, on the kernel's
(`ferrox_jax/sampling.py:sample_checked`, `models/kernels/sample_rows.cc`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.request import RowSampling
from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.sampling import fast_argmax, sample_checked
from models import cpu_kernels

PROBS = np.array([0.4, 0.3, 0.2, 0.1] + [0.0] * 28)  # a vocabulary of 32 (top-20 logprobs need >= 20)
LOGITS = np.log(np.maximum(PROBS, 1e-30)).astype(np.float32)
ROWS = 4000  # one row per seed: frequencies within ~3 sigma = 3*sqrt(.4*.6/4000) ~ 0.023
KERNEL = cpu_kernels.unavailable_reason() is None
_path = {"kernel": False}  # which path `_draw` samples on (the autouse fixture sets it)


@pytest.fixture(autouse=True, params=["xla", "kernel"])
def sampler_path(request):
    if request.param == "kernel" and not KERNEL:
        pytest.skip(f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    _path["kernel"] = request.param == "kernel"
    yield request.param
    _path["kernel"] = False


def _draw(params: RowSampling, rows=ROWS, logits=LOGITS, histories=None, positions=None):
    plist = [RowSampling(**{**params.__dict__, "seed": i}) for i in range(rows)]
    batch = jax.device_put(SamplingArrays.build(plist, histories or [()] * rows, [0] * rows, logits.shape[-1]))
    pos = jnp.asarray(positions if positions is not None else np.full(rows, 5), jnp.int32)
    run = jax.jit(functools.partial(sample_checked, cpu_kernel=_path["kernel"]))
    tokens, lp, top_ids, top_lp, finite = run(jnp.asarray(np.tile(logits, (rows, 1))), pos, batch)
    assert np.asarray(finite).all()
    return np.asarray(tokens), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)


def test_temperature_one_draws_follow_the_probabilities():
    tokens, *_ = _draw(RowSampling(temperature=1.0))
    freq = np.bincount(tokens, minlength=32) / ROWS
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


@pytest.mark.parametrize("params, kept", [
    (RowSampling(top_k=2), {0, 1}),
    (RowSampling(top_k=3), {0, 1, 2}),
    (RowSampling(top_p=0.5), {0, 1}),  # 0.4 before token 1 < 0.5; 0.7 before token 2 >= 0.5
    (RowSampling(top_p=0.75), {0, 1, 2}),
    (RowSampling(min_p=0.6), {0, 1}),  # keep p >= 0.6 * 0.4 = 0.24
    (RowSampling(top_k=3, top_p=0.5), {0, 1}),
])
def test_filters_keep_exactly_the_expected_tokens(params, kept):
    tokens, *_ = _draw(params)
    assert set(np.unique(tokens).tolist()) == kept
    # Survivors are renormalised: token 0 and 1 in ratio 4:3 when {0, 1} survive.
    if kept == {0, 1}:
        assert abs((tokens == 0).mean() - 4 / 7) < 0.03


def test_greedy_takes_the_argmax_and_reports_raw_logprobs():
    tokens, lp, top_ids, top_lp = _draw(RowSampling(temperature=0.0, logprobs=5), rows=3)
    assert tokens.tolist() == [0, 0, 0]
    np.testing.assert_allclose(lp, np.log(0.4), atol=1e-5)
    assert top_ids[0, :4].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(top_lp[0, :4], np.log(PROBS[:4]), atol=1e-5)


def test_draw_depends_only_on_seed_and_position():
    a, *_ = _draw(RowSampling(temperature=1.0), rows=64)
    b, *_ = _draw(RowSampling(temperature=1.0), rows=64)
    c, *_ = _draw(RowSampling(temperature=1.0), rows=64, positions=np.full(64, 6))
    assert (a == b).all(), "same seed and position must draw the same token"
    assert (a != c).any(), "another position must draw differently for some seeds"


def test_penalties_and_logit_bias_change_the_greedy_choice():
    greedy = RowSampling(temperature=0.0)
    assert _draw(greedy, rows=1)[0][0] == 0
    # logit_bias lifts token 3 above everything.
    assert _draw(RowSampling(temperature=0.0, logit_bias=((3, 5.0),)), rows=1)[0][0] == 3
    # Token 0 was generated twice: frequency 0.5 * 2 + presence 0.3 = -1.3 on its logit.
    freq = RowSampling(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3)
    assert _draw(freq, rows=1, histories=[(0, 0)])[0][0] == 1
    # Repetition penalty 3 on seen tokens 0 and 1 (negative logits are multiplied).
    rep = RowSampling(temperature=0.0, repetition_penalty=3.0)
    assert _draw(rep, rows=1, histories=[(0, 1)])[0][0] == 2
    # The reported logprob stays the raw model's.
    assert abs(_draw(RowSampling(temperature=0.0, logit_bias=((3, 5.0),)), rows=1)[1][0] - np.log(0.1)) < 1e-5


def test_fast_argmax_matches_argmax_with_ties():
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 1.0, 5.0], [-1.0, -2.0, -3.0, -0.5]])
    assert fast_argmax(x).tolist() == jnp.argmax(x, axis=-1).tolist() == [1, 0, 3]


def test_top_logprobs_are_skipped_when_no_row_asks():
    _, lp, top_ids, top_lp = _draw(RowSampling(temperature=0.0), rows=2)
    assert (top_lp == 0).all() and (top_ids == 0).all(), "no row asked: the top-20 search is skipped"
    np.testing.assert_allclose(lp, np.log(0.4), atol=1e-5)  # the chosen token's logprob is still exact


@pytest.mark.parametrize("top_k", [32, 33, 2**31, 2**63, 2**80])
def test_top_k_of_the_vocabulary_or_more_is_off_however_large(top_k):
    """A client may send any integer (the fuzzer found 2**63 crashing the step with an
    OverflowError): keeping at least the whole vocabulary is no filter at all."""
    batch = SamplingArrays.build([RowSampling(top_k=top_k, seed=1)], [()], [0], 32)
    assert batch.top_k[0] == 0
    tokens, *_ = _draw(RowSampling(temperature=1.0, top_k=top_k))
    np.testing.assert_allclose(np.bincount(tokens, minlength=32) / ROWS, PROBS, atol=0.03)
