"""The GPU decode-attention candidates (models/gpu_attention.py), each against the pure-JAX loop.

On CPU: gather-xla runs as it would on a GPU; the Pallas GPU kernel runs in Pallas
interpret mode (the same kernel body, simulated); gather-cudnn only through its dispatch
(cuDNN needs a CUDA GPU). On a GPU (tools/device/device_check.py runs this file there) the real
kernel and cuDNN run too, in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner, block_table_width
from models.attention import paged_attention
from models.gpu_attention import (GPU_BACKENDS, GatherDecodeAttention, PallasGpuDecodeAttention,
                                  pallas_gpu_blocking)
from models.loader import load_checkpoint, open_checkpoint
from models.pallas_attention import select_decode_attention
from tests.support.engine_helpers import float32_matmuls, random_paged, shuffled_blocks  # noqa: F401 (autouse: f32 tolerances)

BLOCK_SIZE = 8
NUM_BLOCKS = 64
TABLE_BLOCKS = 8  # 8 blocks * 8 = 64 positions per row
LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 33, TABLE_BLOCKS * BLOCK_SIZE]
ON_GPU = jax.default_backend() in GPU_BACKENDS


def _random_paged(lengths, **kwargs):
    return random_paged(lengths, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, table_blocks=TABLE_BLOCKS, **kwargs)


CPU_CANDIDATES = {
    "gather-xla": GatherDecodeAttention("xla"),
    # (pages per compute block, k_splits): one partition; 4 partitions of 2 blocks, whose
    # partial softmaxes the kernel's wrapper combines; 2 partitions of 4.
    "pallas-interpret-8x1": PallasGpuDecodeAttention(8, 1, interpret=True),
    "pallas-interpret-2x4": PallasGpuDecodeAttention(2, 4, interpret=True),
    "pallas-interpret-4x2": PallasGpuDecodeAttention(4, 2, interpret=True),
}


# On a GPU the interpreted kernel only repeats, slowly, what the real one shows below.
SKIP_INTERPRET_ON_GPU = pytest.mark.skipif(ON_GPU, reason="the real kernel is tested on a GPU")


@pytest.mark.parametrize("name", [n if not n.startswith("pallas") else pytest.param(n, marks=SKIP_INTERPRET_ON_GPU)
                                  for n in sorted(CPU_CANDIDATES)])
def test_candidate_matches_pure_jax_decode_attention(name):
    q, k, v, tables, positions = _random_paged(LENGTHS)
    ref = paged_attention(q, k, v, tables, positions, 0.25)
    attend = CPU_CANDIDATES[name]
    got = jax.jit(lambda *a: attend(*a, 0.25))(q, k, v, tables, positions)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    # float32 on both sides over <= 64 keys; only the summation order differs.
    err = float(jnp.abs(got - ref).max())
    assert err < 1e-5, f"{name} differs from the pure-JAX loop by {err}"


@pytest.mark.parametrize("name", ["gather-xla", pytest.param("pallas-interpret-2x4", marks=SKIP_INTERPRET_ON_GPU)])
def test_candidate_ignores_keys_past_the_row_length(name):
    """Negative control: garbage after each row's last position changes nothing until a
    row's position moves over it."""
    attend = jax.jit(lambda *a: CPU_CANDIDATES[name](*a, 0.25))
    q, k, v, tables, positions = _random_paged([5, 12], seed=1)
    before = attend(q, k, v, tables, positions)
    poisoned = k.at[:, tables[0, 0], 5:].set(1e4)  # row 0 ends at offset 4 of its first block
    assert float(jnp.abs(attend(q, poisoned, v, tables, positions) - before).max()) == 0.0
    moved = attend(q, poisoned, v, tables, positions + jnp.asarray([[3], [0]]))
    assert float(jnp.abs(moved[0] - before[0]).max()) > 1e-3, "a longer row must see the poisoned keys"


@pytest.mark.parametrize("attend", [GatherDecodeAttention("xla"), PallasGpuDecodeAttention(8, 1, interpret=True)])
def test_candidates_reject_more_than_one_query_per_row(attend):
    q, k, v, tables, positions = _random_paged([4, 4])
    with pytest.raises(ValueError, match="one query per row; got T=2"):
        attend(jnp.concatenate([q, q], 1), k, v, tables, positions, 0.25)


def test_model_decode_through_each_candidate_matches_pure_jax(tiny_llama):
    """Whole tiny Llama: prefill (pure JAX either way) then 3 decode steps through each
    candidate, fed the reference's greedy tokens so every candidate sees the same inputs."""
    head_dim = open_checkpoint(str(tiny_llama)).config.head_dim
    blocks = tuple(shuffled_blocks(8, 64, seed=4))
    prompt = tuple(np.random.RandomState(5).randint(3, 300, 11).tolist())

    def run(name, tokens=prompt):
        attend, _ = select_decode_attention(name, head_dim=head_dim, block_size=8, backend="cpu",
                                            max_blocks_per_row=block_table_width(64, 8), kv_dtype=jnp.float32)
        model = load_checkpoint(str(tiny_llama), decode_attention=attend).model
        runner = ModelRunner(model, num_blocks=64, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=64)
        out = [runner.run_logits([RowPlan(0, prompt, 0, blocks, False)])[0][-1]]
        tokens = list(tokens)
        for pos in range(len(prompt), len(prompt) + 3):
            if len(tokens) <= pos:
                tokens.append(int(out[-1].argmax()))
            out.append(runner.run_logits([RowPlan(0, (tokens[pos],), pos, blocks, False)])[0][-1])
        return np.stack(out), tokens

    ref, tokens = run("jax")
    for name in ("gather-xla",) if ON_GPU else ("gather-xla", "pallas-gpu-interpret"):
        got, _ = run(name, tokens)
        assert np.abs(ref[0] - got[0]).max() == 0.0, "prefill never uses the candidate"
        decode_err = np.abs(ref[1:] - got[1:]).max()
        assert decode_err < 1e-4, f"{name}: decode logits differ by {decode_err} (float32 both)"
        assert (ref.argmax(-1) == got.argmax(-1)).all()


# ---- on a CUDA GPU: the real kernel and cuDNN, in bf16 -----------------------------------

@pytest.mark.device
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the device check runs it)")
@pytest.mark.parametrize("impl", ["pallas-gpu", "gather-cudnn", "gather-xla"])
def test_gpu_candidate_matches_pure_jax_in_bf16(impl):
    q, k, v, tables, positions = _random_paged(LENGTHS, kv_heads=8, heads=32, head_dim=128, dtype=jnp.bfloat16)
    attend, _ = select_decode_attention(impl, head_dim=128, block_size=BLOCK_SIZE, max_blocks_per_row=TABLE_BLOCKS,
                                        kv_dtype=jnp.bfloat16)
    ref = np.asarray(paged_attention(q, k, v, tables, positions, 128**-0.5))
    got = np.asarray(jax.jit(lambda *a: attend(*a, 128**-0.5))(q, k, v, tables, positions))
    # bf16 K/V and softmax weights (2^-8 relative, a few roundings apart): 2e-2 relative L2.
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert np.isfinite(got).all() and rel < 2e-2, f"{impl}: relative error {rel:.2e} against the pure-JAX loop"


# ---- dispatch ----------------------------------------------------------------------------

def _select(impl, backend, head_dim=128, block_size=16, max_blocks_per_row=256, kv_dtype=jnp.bfloat16):
    return select_decode_attention(impl, head_dim=head_dim, block_size=block_size,
                                   max_blocks_per_row=max_blocks_per_row, backend=backend, kv_dtype=kv_dtype)


def test_the_pallas_gpu_choice_for_llama_3_8b():
    attend, why = _select("pallas-gpu", "gpu")
    # 128 keys per tile / 16 positions per block = 8 blocks; 256 blocks / 8 = 32 tiles,
    # capped at 16 partitions of the row.
    assert attend == PallasGpuDecodeAttention(8, 16) and "k_splits=16" in why


@pytest.mark.parametrize("block_size,width,expected", [(16, 256, (8, 16)), (16, 8, (8, 1)), (8, 24, (16, 2)),
                                                       (32, 8, (4, 2)), (48, 8, (1, 8))])
def test_pallas_gpu_blocking(block_size, width, expected):
    assert pallas_gpu_blocking(block_size, width) == expected


@pytest.mark.parametrize("impl", ["pallas-gpu", "gather-cudnn"])
def test_cuda_only_candidates_are_refused_off_a_gpu(impl):
    with pytest.raises(ValueError, match="needs a CUDA GPU backend; this one is 'cpu'"):
        _select(impl, "cpu")


def test_gather_cudnn_refuses_a_float32_cache():
    with pytest.raises(ValueError, match="needs a bfloat16 or float16 KV cache; this one is float32"):
        _select("gather-cudnn", "gpu", kv_dtype=jnp.float32)


@pytest.mark.parametrize("head_dim,block_size,match", [(80, 16, "head_dim 80 is not a power of two"),
                                                       (128, 48, "48-key tile")])
def test_pallas_gpu_refuses_shapes_triton_cannot_tile(head_dim, block_size, match):
    with pytest.raises(ValueError, match=match):
        _select("pallas-gpu", "gpu", head_dim=head_dim, block_size=block_size)


def test_gather_xla_and_the_interpreted_kernel_run_anywhere():
    assert _select("gather-xla", "cpu")[0] == GatherDecodeAttention("xla")
    assert _select("pallas-gpu-interpret", "cpu")[0] == PallasGpuDecodeAttention(8, 16, interpret=True)
