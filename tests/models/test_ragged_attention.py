"""The ragged paged-attention kernels (TPU and GPU, in Pallas interpret mode on the CPU)
against the pure-JAX paged attention, on one mixed step as the runner lays it out.

The step (block size 8, shuffled block ids so the tables matter):

    decode rows   contexts 1, 7, 8, 9 and 26 (1, bs - 1, bs, bs + 1, four blocks)
                  a speculating row: its last token and 3 drafts at positions 16..19,
                  four one-token rows sharing a table (one span of 1 + 3)
                  two padding rows
    chunk rows    11 tokens from position 0 (a prompt's first chunk)
                  16 tokens from position 5 (a chunk that starts mid-block)
                  7 tokens from position 16 (resuming after a 2-block prefix-cache hit)
                  one padding row

On a CUDA GPU (the device check's parity phase) the compiled Triton kernel runs instead of
the interpreted ones. Each case is one family's attention features; together they cover GQA ratios 1/2/4/8,
head dims 64/80/128/256, float32 and bfloat16 caches (bfloat16 as its 16-bit words, the
CPU engine's storage, in the head-dim-80 case), sliding windows, soft-capping and sinks.
K/V steps of 16 keys, so every row of 9+ keys walks several of them (the TPU kernel's
double buffering, a window's skipped steps). Padding tokens must come out zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models import ragged_gpu, ragged_tpu
from models.attention import paged_attention
from models.layers import Segment
from models.ragged_attention import TileMasks, attend_tile, ragged_reference, ragged_spans
from models.ragged_gpu import GpuRaggedAttention
from models.ragged_tpu import TpuRaggedAttention
from tests.support.engine_helpers import float32_matmuls  # noqa: F401 (autouse: f32 tolerances)

BLOCK_SIZE = 8
NUM_BLOCKS = 64
TABLE_BLOCKS = 8
CHUNK_TOKENS = 16
SCALE = 0.3
# float32: both sides accumulate in f32; only the summation order differs (tiles of 16
# keys here, chunks of 64 there).
F32_TOL = 1e-5
# bfloat16 q and K/V: the probabilities are rounded to bfloat16 before the weighted sum of
# values on both sides, but against different running maxima (each side's tiles), so the
# roundings differ: up to 2^-8 relative of an output of |v| ~ 1.
BF16_TOL = 2e-2


def _kernels() -> dict:
    """Both kernels in interpret mode on a CPU (the TPU one in the TPU simulator: DMAs,
    semaphores and VMEM simulated, an out-of-bounds read raises, unwritten VMEM reads NaN);
    on a GPU (the device check's parity phase) the compiled Triton kernel. 16 keys per K/V
    step: several steps per row here."""
    backend = jax.default_backend()
    if backend == "cpu":
        return {"tpu": TpuRaggedAttention(q_tile_tokens=16, keys_per_tile=16, interpret=pltpu.InterpretParams()),
                "gpu": GpuRaggedAttention(keys_per_tile=16, interpret=True)}
    return {"gpu": GpuRaggedAttention(keys_per_tile=16)} if backend in ("gpu", "cuda") else {}


KERNELS = _kernels()


@dataclasses.dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # q (compute) dtype
    kv_dtype: str  # "float32", "bfloat16", or "bfloat16-words" (uint16 storage)
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    @property
    def tol(self) -> float:
        # A bfloat16 cache under float32 compute is widened exactly: float32's tolerance.
        return F32_TOL if self.dtype == "float32" else BF16_TOL


CASES = {
    "llama-gqa4-hd64-f32": Case(8, 2, 64, "float32", "float32"),
    "mistral-window-gqa8-hd128-bf16": Case(8, 1, 128, "bfloat16", "bfloat16", window=11),
    "gemma2-window-softcap-gqa2-hd256-bf16": Case(4, 2, 256, "bfloat16", "bfloat16", window=7, softcap=5.0),
    "phi3-window-mha-hd80-f32-over-bf16-words": Case(2, 2, 80, "float32", "bfloat16-words", window=9),
    "sinks-gqa8-hd64-f32": Case(8, 1, 64, "float32", "float32", sinks=True),
}


def mixed_step(case: Case, seed: int = 0):
    """(q [N, H, hd], k, v [K, NB, bs, hd], segments, sinks) of the module docstring's step."""
    rng = np.random.RandomState(seed)
    ids = list(rng.permutation(np.arange(1, NUM_BLOCKS)))

    def table(positions: int) -> np.ndarray:
        t = np.zeros(TABLE_BLOCKS, np.int32)
        for i in range(-(-positions // BLOCK_SIZE)):
            t[i] = ids.pop()
        return t

    decode = [(n - 1, table(n)) for n in (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 26)]
    verify = table(20)
    decode += [(16 + j, verify) for j in range(4)] + [(None, np.zeros(TABLE_BLOCKS, np.int32))] * 2
    chunks = []
    for start, count in ((0, 11), (5, CHUNK_TOKENS), (2 * BLOCK_SIZE, 7), (0, 0)):
        positions = np.zeros(CHUNK_TOKENS, np.int32)
        positions[:count] = np.arange(start, start + count)
        chunks.append((positions, np.arange(CHUNK_TOKENS) < count,
                       table(start + count) if count else np.zeros(TABLE_BLOCKS, np.int32)))
    rows = len(decode)
    segments = (
        Segment(0, rows, 1, jnp.asarray([[p or 0] for p, _ in decode], jnp.int32),
                jnp.asarray([[p is not None] for p, _ in decode]), jnp.asarray(np.stack([t for _, t in decode]))),
        Segment(rows, len(chunks), CHUNK_TOKENS, jnp.asarray(np.stack([c[0] for c in chunks])),
                jnp.asarray(np.stack([c[1] for c in chunks])), jnp.asarray(np.stack([c[2] for c in chunks]))))
    n = rows + len(chunks) * CHUNK_TOKENS
    shape = (case.kv_heads, NUM_BLOCKS, BLOCK_SIZE, case.head_dim)
    k, v = (jnp.asarray(rng.randn(*shape), jnp.float32) for _ in range(2))
    if case.kv_dtype == "bfloat16-words":
        k, v = (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16) for x in (k, v))
    else:
        k, v = k.astype(case.kv_dtype), v.astype(case.kv_dtype)
    q = jnp.asarray(rng.randn(n, case.heads, case.head_dim), jnp.float32).astype(case.dtype)
    sinks = jnp.asarray(rng.randn(case.heads) + 1.0, jnp.float32) if case.sinks else None
    return q, k, v, segments, sinks


def paged_reference(case: Case, q, k, v, segments):
    """The engine's pure-JAX path (`models/attention.py`), segment by segment; padding zeroed."""
    outs = []
    for seg in segments:
        q_seg = q[seg.start:seg.stop].reshape(seg.rows, seg.tokens, *q.shape[1:])
        out = paged_attention(q_seg, k, v, seg.block_tables, seg.positions, SCALE, valid=seg.valid,
                              window=case.window, softcap=case.softcap)
        outs.append(jnp.where(seg.valid[..., None, None], out, 0.0).reshape(seg.rows * seg.tokens, *q.shape[1:]))
    return jnp.concatenate(outs)


def reference(case: Case, q, k, v, segments, sinks):
    """The pure-JAX loop where it applies; with sinks (which it does not know) the dense
    ragged reference, itself checked against the loop by
    test_dense_reference_matches_the_paged_loop."""
    if sinks is not None:
        return ragged_reference(q, k, v, ragged_spans(segments), scale=SCALE, window=case.window,
                                softcap=case.softcap, sinks=sinks)
    return paged_reference(case, q, k, v, segments)


def kernel_error(kernel, case: Case, seed: int = 0) -> float:
    q, k, v, segments, sinks = mixed_step(case, seed)
    spans = ragged_spans(segments)
    got = jax.jit(lambda q, k, v, spans, sinks: kernel(q, k, v, spans, scale=SCALE, window=case.window,
                                                       softcap=case.softcap, sinks=sinks))(q, k, v, spans, sinks)
    want = reference(case, q, k, v, segments, sinks)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert bool(jnp.isfinite(got).all()), "the kernel produced a non-finite output"
    return float(jnp.abs(got - want).max())


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("which", KERNELS)
def test_ragged_kernel_matches_pure_jax_on_a_mixed_step(which, name):
    case = CASES[name]
    err = kernel_error(KERNELS[which], case)
    print(f"{which} {name}: max |delta| {err:.2e} (tolerance {case.tol:g})")
    assert err <= case.tol, f"{which} kernel, {name}: max |delta| {err:.2e} against pure JAX exceeds {case.tol:g}"


def test_dense_reference_matches_the_paged_loop():
    """The sinks cases' reference: without sinks it is the engine's loop, window and soft-cap included."""
    case = Case(4, 2, 16, "float32", "float32", window=6, softcap=4.0)
    q, k, v, segments, _ = mixed_step(case, seed=3)
    dense = ragged_reference(q, k, v, ragged_spans(segments), scale=SCALE, window=case.window, softcap=case.softcap)
    err = float(jnp.abs(dense - paged_reference(case, q, k, v, segments)).max())
    assert err <= F32_TOL, f"dense reference differs from the paged loop by {err:.2e}"


def test_sinks_change_the_output():
    """A sink takes probability mass: without it the output is measurably different (the
    sinks case cannot pass by ignoring them)."""
    case = CASES["sinks-gqa8-hd64-f32"]
    q, k, v, segments, sinks = mixed_step(case)
    spans = ragged_spans(segments)
    with_sinks = ragged_reference(q, k, v, spans, scale=SCALE, sinks=sinks)
    without = ragged_reference(q, k, v, spans, scale=SCALE)
    assert float(jnp.abs(with_sinks - without).max()) > 100 * F32_TOL


# ---- negative controls: a broken mask must fail the parity check -----------------------------

def _broken_causal(carry, q, k, v, key_start, masks: TileMasks, **kw):
    """Each query also sees the key after it (an off-by-one causal mask)."""
    return attend_tile(carry, q, k, v, key_start, dataclasses.replace(masks, row_pos=masks.row_pos + 1), **kw)


def _broken_window(carry, q, k, v, key_start, masks, *, window, **kw):
    """A window one key too wide."""
    return attend_tile(carry, q, k, v, key_start, masks, window=None if window is None else window + 1, **kw)


@pytest.mark.parametrize("which,module", [(w, m) for w, m in (("tpu", ragged_tpu), ("gpu", ragged_gpu))
                                          if w in KERNELS])
def test_a_broken_causal_mask_fails_the_parity_check(monkeypatch, which, module):
    case = CASES["llama-gqa4-hd64-f32"]
    monkeypatch.setattr(module, "attend_tile", _broken_causal)
    err = kernel_error(KERNELS[which], case)
    assert err > 100 * case.tol, f"{which}: a query seeing the next key moved the output by only {err:.2e}"


@pytest.mark.skipif("gpu" not in KERNELS, reason="no GPU kernel on this backend")
def test_a_broken_window_fails_the_parity_check(monkeypatch):
    case = CASES["phi3-window-mha-hd80-f32-over-bf16-words"]
    monkeypatch.setattr(ragged_gpu, "attend_tile", _broken_window)
    err = kernel_error(KERNELS["gpu"], case)
    assert err > 10 * case.tol, f"a window one key too wide moved the output by only {err:.2e}"


# ---- spans ------------------------------------------------------------------------------------

def test_spans_of_the_mixed_step():
    """Rows in flat order; the speculating row's four one-token rows are one span of 4."""
    _, _, _, segments, _ = mixed_step(CASES["llama-gqa4-hd64-f32"])
    spans = ragged_spans(segments)
    # 5 decode rows, the 1 + 3 verification span, 2 padding rows, 4 chunk rows, then the
    # 3 rows merged away (start at the flat end, 11 + 4 * 16 = 75).
    assert spans.q_starts.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 27, 43, 59, 75, 75, 75]
    assert spans.q_lens.tolist() == [1, 1, 1, 1, 1, 4, 0, 0, 11, 16, 7, 0, 0, 0, 0]
    assert spans.kv_lens.tolist() == [1, 7, 8, 9, 26, 20, 0, 0, 11, 21, 23, 0, 0, 0, 0]
    ends = np.asarray(spans.q_starts + spans.q_lens)
    assert (np.diff(ends) >= 0).all(), "span ends must not decrease (the kernels bisect them)"


def test_one_token_rows_with_different_tables_stay_apart():
    """Consecutive positions alone do not merge rows: two requests' rows keep their spans."""
    tables = jnp.asarray([[1, 0], [2, 0]], jnp.int32)
    seg = Segment(0, 2, 1, jnp.asarray([[3], [4]], jnp.int32), jnp.ones((2, 1), bool), tables)
    spans = ragged_spans((seg,))
    assert spans.q_lens.tolist() == [1, 1] and spans.kv_lens.tolist() == [4, 5]


# ---- the choice -------------------------------------------------------------------------------

def _select(impl, backend, block_size=16, kv_dtype=jnp.bfloat16, head_dim=64):
    from models.pallas_attention import select_decode_attention

    return select_decode_attention(impl, head_dim=head_dim, block_size=block_size, max_blocks_per_row=64,
                                   backend=backend, kv_dtype=kv_dtype)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_auto_picks_the_ragged_kernel_on_tpu_for_any_head_dim(head_dim):
    kernel, why = _select("auto", "tpu", head_dim=head_dim)
    assert kernel == TpuRaggedAttention() and "Pallas TPU (Mosaic)" in why


@pytest.mark.parametrize("backend", ["gpu", "cuda"])
def test_auto_picks_the_ragged_kernel_on_a_cuda_gpu(backend):
    kernel, why = _select("auto", backend)
    assert kernel == GpuRaggedAttention() and "Pallas GPU (Triton)" in why


def test_auto_on_cpu_keeps_the_cpu_path():
    kernel, _ = _select("auto", "cpu", kv_dtype=jnp.float32)
    assert not isinstance(kernel, (TpuRaggedAttention, GpuRaggedAttention)), "make serve must not change on a CPU"


def test_auto_falls_back_with_the_reason_when_the_tiling_refuses_the_block_size():
    kernel, why = _select("auto", "tpu", block_size=8)  # a bfloat16 VMEM tile has 16 rows
    assert kernel is None and "block_size 8 is not a multiple of 16" in why
    kernel, why = _select("auto", "cuda", block_size=12)
    assert kernel is None and "block_size 12 is not a power of two" in why


def test_a_named_ragged_kernel_off_its_backend_is_an_error():
    with pytest.raises(ValueError, match="ragged-tpu needs a TPU backend; this one is 'cpu'"):
        _select("ragged-tpu", "cpu")
    with pytest.raises(ValueError, match="ragged-gpu needs a CUDA GPU backend"):
        _select("ragged-gpu", "tpu")


def test_interpret_mode_runs_anywhere():
    assert _select("ragged-tpu-interpret", "cpu", block_size=12)[0] == TpuRaggedAttention(
        interpret=pltpu.InterpretParams())
    assert _select("ragged-gpu-interpret", "cpu")[0] == GpuRaggedAttention(interpret=True)
