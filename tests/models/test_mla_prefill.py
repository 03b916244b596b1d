"""Multi-head latent attention's expanded prefill (`models/mla.py:expanded_attention`)
against the absorbed path on the tiny DeepSeek-V3 checkpoint of
tests/models/test_family_deepseek_v3.py: a prompt in one chunk, in two chunks (the second
over a cached prefix), two rows batched, and the greedy decode steps after (absorbed both
ways, over the cache the prefill wrote); HF's logits for the expanded prefill; zero
recompiles after warm-up with every prompt chunk expanded. Negative control: the expanded
path reading each head's kv_b_proj columns as [v | k_nope] instead of [k_nope | v]."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.support import family_checks as fc

TOL = 1e-5
PROMPT = np.random.RandomState(7).randint(3, 380, 40).tolist()


def with_expand(model, expand_from: int):
    """`model` with every layer's prompt chunks of >= expand_from tokens expanded (0: none)."""
    for layer in model.layers:
        layer.mla_spec = dataclasses.replace(layer.mla_spec, expand_from=expand_from)
    return model


def load(path, expand_from):
    from models.loader import load_checkpoint

    return with_expand(load_checkpoint(str(path)).model, expand_from)


def runner(model):
    from tests.support.sharding_probe import _runner

    return _runner(model, 1, max_chunk_tokens=64)


def logits(model) -> dict:
    """Per case, the logits the runner returns (each case on fresh blocks of one runner)."""
    from ferrox_jax.plan import RowPlan
    from tests.support.sharding_probe import prefill_then_decode_logits

    run = runner(model)
    out = {}
    out["prefill"], out["decode"] = prefill_then_decode_logits(run, PROMPT, 3, tuple(range(1, 9)))

    def row(i, tokens, start, blocks):
        return RowPlan(row_id=i, token_ids=tuple(tokens), start_pos=start, block_ids=blocks, sample=False)

    blocks = tuple(range(9, 17))
    run.run_logits([row(0, PROMPT[:24], 0, blocks)])
    out["chunked"] = run.run_logits([row(0, PROMPT[24:], 24, blocks)])[0]  # 16 new over a 24-token prefix
    out["batched"] = np.concatenate(run.run_logits([row(0, PROMPT, 0, tuple(range(17, 25))),
                                                    row(1, PROMPT[5:31], 0, tuple(range(25, 33)))]))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.models.test_family_deepseek_v3 import _config

    return fc.make_checkpoint(tmp_path_factory.mktemp("mla") / "tiny-deepseek-v3", _config())


@pytest.fixture(scope="module")
def absorbed(checkpoint):
    return logits(load(checkpoint, 0))


def swapped_halves(monkeypatch):
    """The expanded path with each head's kv_b_proj columns read as [v | k_nope]."""
    import jax.numpy as jnp

    from models import mla

    real = mla.expanded_attention

    def wrong(q_nope, q_rope, k_cache, seg, spec, w_uk, w_uv):
        per_head = jnp.concatenate([w_uk, w_uv], axis=-1)
        return real(q_nope, q_rope, k_cache, seg, spec, per_head[..., spec.v_dim:], per_head[..., :spec.v_dim])

    monkeypatch.setattr(mla, "expanded_attention", wrong)


def test_default_expands_prompt_chunks_of_128_tokens_only(checkpoint):
    from models.loader import load_checkpoint
    from models.mla import expands

    spec = load_checkpoint(str(checkpoint)).config.mla_spec()
    assert spec.expand_from == 128
    assert expands(spec, 128) and expands(spec, 512) and not expands(spec, 127) and not expands(spec, 1)
    assert not expands(dataclasses.replace(spec, expand_from=0), 512)
    assert not expands(dataclasses.replace(spec, expand_from=1), 1), "decode stays absorbed"


def test_expanded_prefill_matches_absorbed(checkpoint, absorbed):
    got = logits(load(checkpoint, 2))  # every prompt chunk of 2+ tokens expanded
    for case in ("prefill", "chunked", "batched", "decode"):
        err = float(np.abs(got[case] - absorbed[case]).max())
        assert err < TOL, f"{case}: expanded differs from absorbed by {err}"
    assert (got["decode"].argmax(-1) == absorbed["decode"].argmax(-1)).all()


def test_expanded_prefill_matches_transformers(checkpoint):
    hf = fc.hf_logits(fc.hf_model(checkpoint), PROMPT)
    got = logits(load(checkpoint, 2))["prefill"]
    assert float(np.abs(got - hf).max()) < TOL


def test_control_swapped_kv_b_halves_fail(checkpoint, absorbed, monkeypatch):
    swapped_halves(monkeypatch)
    # expand_from 3, not 2: another static spec, so the step is traced again with the
    # patch rather than taken from jit's cache (every chunk here is still expanded)
    got = logits(load(checkpoint, 3))
    for case in ("prefill", "chunked", "batched"):
        assert float(np.abs(got[case] - absorbed[case]).max()) > 100 * TOL, case


def test_no_recompiles_after_warmup_with_prompt_chunks_expanded(checkpoint):
    from tests.support.sharding_probe import _runner, mixed_workload

    run = _runner(load(checkpoint, 2), 1)
    run.warmup()
    mixed_workload(run)
    assert run.recompiles_after_warmup == 0
