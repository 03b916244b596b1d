"""Small helpers for engine tests: build a runner on a tiny checkpoint, run rows."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from ferrox_jax.plan import RowStep, StepPlan
from ferrox_jax.request import SamplingParams
from ferrox_jax.runner import ModelRunner
from models.loader import load_checkpoint


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Autouse in every module that imports it: those compare float32 results at float32
    tolerances, so their matmuls must be float32 on any backend (XLA on a GPU may use TF32
    for them by default; on CPU this changes nothing)."""
    with jax.default_matmul_precision("highest"):
        yield


def make_runner(path, num_blocks=96, block_size=8, max_rows=8, max_prefill_tokens=64, max_context=256):
    ckpt = load_checkpoint(str(path))
    return ModelRunner(ckpt.model, num_blocks=num_blocks, block_size=block_size, max_rows=max_rows,
                       max_prefill_tokens=max_prefill_tokens, max_context=max_context), ckpt


def shuffled_blocks(n: int, num_blocks: int, seed: int) -> list[int]:
    """n distinct non-null block ids in a shuffled order."""
    return np.random.RandomState(seed).permutation(np.arange(1, num_blocks))[:n].tolist()


def generate_alone(runner, prompt, max_new, blocks, sampling=SamplingParams(temperature=0.0), chunk=None):
    """Prefill (chunked by `chunk`) then decode one row by itself; returns the tokens."""
    chunk = chunk or runner.max_prefill_tokens
    pos = 0
    out = []
    while pos < len(prompt):
        ids = prompt[pos:pos + chunk]
        last = pos + len(ids) == len(prompt)
        res = runner.run(StepPlan(prefill=(RowStep(row_id=1, token_ids=tuple(ids), start_pos=pos,
                                                   block_ids=tuple(blocks), sample=last, sampling=sampling),)))
        pos += len(ids)
    out.append(res.results[1].token_id)
    while len(out) < max_new:
        step = RowStep(row_id=1, token_ids=(out[-1],), start_pos=len(prompt) + len(out) - 1,
                       block_ids=tuple(blocks), sample=True, sampling=sampling)
        out.append(runner.run(StepPlan(decode=(step,))).results[1].token_id)
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
