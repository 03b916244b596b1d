"""Small helpers for engine tests: build a runner on a tiny checkpoint, run rows."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.step_output import run_plan
from ferrox_jax.request import RowSampling
from ferrox_jax.runner import ModelRunner
from models.loader import load_checkpoint


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Autouse in every module that imports it: those compare float32 results at float32
    tolerances, so their matmuls must be float32 on any backend (XLA on a GPU may use TF32
    for them by default; on CPU this changes nothing)."""
    with jax.default_matmul_precision("highest"):
        yield


def prompt_logits(model, prompt, block_ids) -> np.ndarray:
    """f32[len(prompt), V]: the logits at every prompt position, one prefill through a
    fresh runner (blocks of 8, up to 48 blocks)."""
    runner = ModelRunner(model, num_blocks=48, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128)
    return runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=block_ids,
                                      sample=False)])[0]


def default_model_case():
    """The default model's checkpoint source, a 26-token prompt of two kinds of text, its
    shuffled blocks, and float32's logits over it (f64) - what the quantized modes of the
    default model are measured against."""
    from models.loader import open_checkpoint

    source = open_checkpoint("default")
    prompt = source.tokenizer.encode("The capital of France is Paris. Once upon a time, in a small village by the sea,")
    blocks = tuple(shuffled_blocks(4, 48, seed=9))
    return source, prompt, blocks, prompt_logits(source.build(), prompt, blocks).astype(np.float64)


def make_runner(path, num_blocks=96, block_size=8, max_rows=8, max_chunk_tokens=64, max_context=256, max_chunks=1):
    ckpt = load_checkpoint(str(path))
    return ModelRunner(ckpt.model, num_blocks=num_blocks, block_size=block_size, max_rows=max_rows,
                       max_chunk_tokens=max_chunk_tokens, max_context=max_context, max_chunks=max_chunks), ckpt


def shuffled_blocks(n: int, num_blocks: int, seed: int) -> list[int]:
    """n distinct non-null block ids in a shuffled order."""
    return np.random.RandomState(seed).permutation(np.arange(1, num_blocks))[:n].tolist()


def generate_alone(runner, prompt, max_new, blocks, sampling=RowSampling(temperature=0.0), chunk=None):
    """Prefill (chunked by `chunk`) then decode one row by itself; returns the tokens."""
    chunk = chunk or runner.max_chunk_tokens
    pos = 0
    out = []
    while pos < len(prompt):
        ids = prompt[pos:pos + chunk]
        last = pos + len(ids) == len(prompt)
        res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=1, token_ids=tuple(ids), start_pos=pos,
                                                   block_ids=tuple(blocks), sample=last, sampling=sampling),)))
        pos += len(ids)
    out.append(res.results[1].token_id)
    while len(out) < max_new:
        step = RowPlan(row_id=1, token_ids=(out[-1],), start_pos=len(prompt) + len(out) - 1,
                       block_ids=tuple(blocks), sample=True, sampling=sampling)
        out.append(run_plan(runner, StepPlan(decode=(step,))).results[1].token_id)
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def random_paged(lengths, *, num_blocks: int, block_size: int, table_blocks: int, seed: int = 0, kv_heads: int = 2,
                 heads: int = 4, head_dim: int = 16, dtype=jnp.float32, kv_rounded_to=None):
    """Random one-query decode inputs over a paged cache: (q [B, 1, H, hd], k, v [K, N, bs,
    hd], block tables [B, table_blocks] of shuffled block ids, positions [B, 1]) for rows of
    `lengths` keys. `kv_rounded_to`: a dtype K and V values are made representable in
    (a kernel that casts pages to it then sees the same numbers)."""
    rng = np.random.RandomState(seed)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    if kv_rounded_to is None:
        k, v = (jnp.asarray(rng.randn(*shape), dtype) for _ in range(2))
    else:
        k, v = (jnp.asarray(rng.randn(*shape), kv_rounded_to).astype(dtype) for _ in range(2))
    q = jnp.asarray(rng.randn(len(lengths), 1, heads, head_dim), dtype)
    ids = rng.permutation(np.arange(1, num_blocks))  # shuffled, so the table matters
    tables = np.zeros((len(lengths), table_blocks), np.int32)
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[i, :used] = ids[i * table_blocks:i * table_blocks + used]
    positions = jnp.asarray(np.asarray(lengths)[:, None] - 1, jnp.int32)
    return q, k, v, jnp.asarray(tables), positions
