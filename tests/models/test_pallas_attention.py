"""The Pallas TPU paged-attention kernel (in interpret mode on CPU) and its dispatch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner, block_table_width
from models.attention import paged_attention
from models.loader import load_checkpoint, open_checkpoint
from models.pallas_attention import PallasDecodeAttention, pages_per_compute_block, select_decode_attention
from tests.support.engine_helpers import random_paged, shuffled_blocks

BLOCK_SIZE = 8
NUM_BLOCKS = 64
TABLE_BLOCKS = 8  # 8 blocks * 8 = 64 positions per row


def _random_paged(lengths, seed=0):
    # bf16-representable K/V: the kernel casts pages to bfloat16 in VMEM, so with values
    # that survive that cast exactly both paths see identical keys and values.
    return random_paged(lengths, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, table_blocks=TABLE_BLOCKS, seed=seed,
                        kv_rounded_to=jnp.bfloat16)


@pytest.mark.parametrize("ppcb", [1, 4, 8])
def test_kernel_matches_pure_jax_decode_attention(ppcb):
    lengths = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 33, TABLE_BLOCKS * BLOCK_SIZE]
    q, k, v, tables, positions = _random_paged(lengths)
    scale = 0.25
    ref = paged_attention(q, k, v, tables, positions, scale)
    kernel = PallasDecodeAttention(ppcb, interpret=True)
    got = jax.jit(lambda *a: kernel(*a, scale))(q, k, v, tables, positions)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    # float32 accumulation on both sides over <= 64 keys; only the summation order differs.
    err = float(jnp.abs(got - ref).max())
    assert err < 1e-5, f"pages_per_compute_block={ppcb}: kernel differs from pure JAX by {err}"


def test_kernel_ignores_keys_past_the_row_length():
    """Negative control: writing garbage after each row's last position changes nothing."""
    lengths = [5, 12]
    q, k, v, tables, positions = _random_paged(lengths, seed=1)
    kernel = PallasDecodeAttention(8, interpret=True)
    before = kernel(q, k, v, tables, positions, 0.25)
    # Row 0 ends at position 4 in its first block: poison offsets 5.. of that block.
    poisoned = k.at[:, tables[0, 0], 5:].set(1e4)
    after = kernel(q, poisoned, v, tables, positions, 0.25)
    assert float(jnp.abs(after - before).max()) == 0.0
    moved = kernel(q, poisoned, v, tables, positions + jnp.asarray([[3], [0]]), 0.25)
    assert float(jnp.abs(moved[0] - before[0]).max()) > 1e-3, "a longer row must see the poisoned keys"


def test_kernel_rejects_more_than_one_query_per_row():
    q, k, v, tables, positions = _random_paged([4, 4])
    with pytest.raises(ValueError, match="one query per row; got T=2"):
        PallasDecodeAttention(8, interpret=True)(jnp.concatenate([q, q], 1), k, v, tables, positions, 0.25)


def test_model_decode_through_the_kernel_matches_pure_jax(tiny_llama):
    """Whole tiny Llama: prefill (pure JAX either way) then decode via the kernel."""
    blocks = tuple(shuffled_blocks(8, 64, seed=4))
    prompt = tuple(np.random.RandomState(5).randint(3, 300, 11).tolist())
    logits = {}
    for impl in ("jax", "pallas-interpret"):
        kernel, _ = _select(impl, "cpu", head_dim=open_checkpoint(str(tiny_llama)).config.head_dim, block_size=8,
                            max_blocks_per_row=block_table_width(64, 8))
        model = load_checkpoint(str(tiny_llama), decode_attention=kernel).model
        runner = ModelRunner(model, num_blocks=64, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=64)
        out = [runner.run_logits([RowPlan(0, prompt, 0, blocks, False)])[0][-1]]
        tokens = list(prompt)
        for _ in range(3):
            tokens.append(int(out[-1].argmax()))
            out.append(runner.run_logits([RowPlan(0, (tokens[-1],), len(tokens) - 1, blocks, False)])[0][-1])
        logits[impl] = np.stack(out)
    prefill_err = np.abs(logits["jax"][0] - logits["pallas-interpret"][0]).max()
    decode_err = np.abs(logits["jax"][1:] - logits["pallas-interpret"][1:]).max()
    assert prefill_err == 0.0, "prefill never uses the kernel"
    # The kernel rounds float32 K/V to bfloat16 (relative 2^-8); logits move by ~1e-3.
    assert decode_err < 2e-2, f"decode logits differ by {decode_err}"
    assert (logits["jax"].argmax(-1) == logits["pallas-interpret"].argmax(-1)).all()


# ---- dispatch --------------------------------------------------------------------------

def _select(impl, backend, head_dim=128, block_size=16, max_blocks_per_row=64):
    return select_decode_attention(impl, head_dim=head_dim, block_size=block_size,
                                   max_blocks_per_row=max_blocks_per_row, backend=backend)


# (On a CPU backend auto picks ferrox's AVX2 kernel where it can run: tests/models/test_cpu_kernels.py;
# on a TPU or a CUDA GPU the ragged kernels: tests/models/test_ragged_attention.py.)
def test_auto_uses_pure_jax_on_a_backend_without_a_kernel():
    kernel, why = _select("auto", "rocm")
    assert kernel is None and "TPU-only or CUDA-only" in why


def test_auto_falls_back_when_block_size_is_not_a_multiple_of_16():
    kernel, why = _select("auto", "tpu", block_size=8)
    assert kernel is None and "block_size 8" in why


def test_forced_pallas_off_tpu_is_an_error():
    with pytest.raises(ValueError, match="needs a TPU backend; this one is 'cpu'"):
        _select("pallas", "cpu")


def test_forced_pallas_with_unmet_constraints_is_an_error():
    with pytest.raises(ValueError, match="head_dim 64"):
        _select("pallas", "tpu", head_dim=64)


def test_jax_is_always_pure_jax_and_interpret_always_the_kernel():
    assert _select("jax", "tpu")[0] is None
    assert _select("pallas-interpret", "cpu")[0] == PallasDecodeAttention(32, interpret=True)


def test_the_ragged_kernels_are_imported_only_when_one_is_chosen():
    """A CPU server's start-up imports the engine builder, never the ragged kernels' modules
    (Pallas TPU, Triton: tenths of a second); choosing one (interpret mode runs anywhere)
    imports it. Checked in a fresh interpreter, so that nothing this process imported counts;
    the second half is the control that the check sees the modules when they come in."""
    code = ("import sys\n"
            "import ferrox_jax.engine_builder\n"
            "print(sorted(m for m in sys.modules if m in ('models.ragged_gpu', 'models.ragged_tpu')))\n"
            "from models.pallas_attention import select_ragged_attention\n"
            "select_ragged_attention('ragged-gpu-interpret', backend='cpu', block_size=16, kv_dtype=None)\n"
            "print(sorted(m for m in sys.modules if m in ('models.ragged_gpu', 'models.ragged_tpu')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)
    at_start, chosen = out.stdout.strip().splitlines()
    assert at_start == "[]", f"importing the engine builder pulled in {at_start}"
    assert chosen == "['models.ragged_gpu', 'models.ragged_tpu']", chosen


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        _select("flash", "tpu")


@pytest.mark.parametrize("block_size,width,expected",
                         [(16, 64, 32), (16, 8, 8), (8, 24, 24), (32, 24, 12), (512, 8, 1)])
def test_pages_per_compute_block_divides_the_table_width(block_size, width, expected):
    got = pages_per_compute_block(block_size, width)
    assert got == expected and width % got == 0 and got * block_size <= max(512, block_size)


def test_the_choice_is_static_in_the_graphdef(tiny_llama):
    """Switching implementation changes the compiled program (it is part of the graphdef)."""
    plain, _ = nnx.split(load_checkpoint(str(tiny_llama)).model)
    kernel, _ = nnx.split(load_checkpoint(str(tiny_llama), decode_attention=PallasDecodeAttention(8, interpret=True)).model)
    assert kernel != plain
