"""Speculative decoding by prompt lookup on the default model (SmolLM2-135M): the greedy
tokens are the non-speculative ones alone and batched, at a fixed draft length and at the
adaptive one (drafts kept past k), with no shape beyond the runner's compile keys.

The tiny families, sampling, stops and tensor parallelism are tests/engine/test_speculative.py;
this check loads the default model and is a file of its own so the two run on both workers."""

from __future__ import annotations

import dataclasses

import pytest

from ferrox_jax.request import Job
from tests.engine.test_speculative import _assert_same
from tests.support.engine_helpers import make_runner
from tests.support.spec_driver import GREEDY, SPEC, STEP_ROWS, drive


@pytest.mark.slow
def test_default_model_greedy_identical_alone_and_batched():
    runner, ckpt = make_runner("default", num_blocks=48, block_size=16, max_rows=STEP_ROWS, max_chunk_tokens=128,
                               max_context=512)
    tok = ckpt.tokenizer
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    prompts = [f"Copy this code exactly, renaming w to width:\n{code}\nCopy:\n", "The capital of France is",
               f"Here is a file:\n{code}\nThe same file:\n"]
    jobs = [Job(request_id=f"d{i}", prompt_token_ids=tuple(tok.encode(p)), max_tokens=40,
                sampling=GREEDY) for i, p in enumerate(prompts)]
    # fixed k, and the adaptive length (up to 12 drafts a row while every draft is kept)
    adaptive = dataclasses.replace(SPEC, max_speculative_tokens=12)
    for batch in ([jobs[0]], jobs):
        off = drive(runner, tok, batch, None)
        for spec in (SPEC, adaptive):
            on = drive(runner, tok, batch, spec)
            _assert_same(off, on, f"default model, {len(batch)} rows, max_speculative_tokens {spec.max_speculative_tokens}")
            counters = on.scheduler.speculator.counters
            assert counters.num_accepted_tokens > 0
            assert on.scheduler.budget.num_held_blocks == 0
    # the batch's "same file" row copies: its drafts grew past k and were kept
    assert any(counters.accepted_per_pos[SPEC.num_speculative_tokens:]), "adaptive: no draft past k was kept"
    assert set(runner._compiled) <= set(runner.compile_keys()), "longer drafts add no shape"
