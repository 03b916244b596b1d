"""ferrox's x86 CPU kernels (models/cpu_kernels.py, models/kernels/): the int8 matmul's
products against an exact numpy reference and XLA's dot, the packing pass, and the engine
on it (logits, zero recompiles, what it reports, `--int8-kernel xla`); the decode
attention against the pure-JAX paged attention, alone and in a model."""

from __future__ import annotations

import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ferrox_jax.config import EngineConfig
from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner
from models import cpu_attention, cpu_kernels
from models.loader import load_checkpoint
from models.quant import QuantizedWeight, quantize, quantized_matmul
from tests.support.engine_helpers import default_model_case, prompt_logits, shuffled_blocks
from tests.support.sharding_probe import mixed_workload


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


# Where `make` can build the kernel (x86-64 Linux with AVX2 and a C++ compiler) it must be
# there: a broken build fails this module instead of silently testing XLA's dot twice.
BUILDABLE = platform.machine() == "x86_64" and _has_avx2() and shutil.which("c++") is not None
pytestmark = pytest.mark.skipif(not BUILDABLE, reason="the kernel needs x86-64 with AVX2 and a C++ compiler")


def test_the_kernel_is_built_and_registered():
    assert cpu_kernels.unavailable_reason() is None


def _reference(x: np.ndarray, values_t: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel's contract in numpy: quantize_rows' int8 (scale amax * (1/127) as XLA
    computes amax / 127, f32 division, round half to even, clip), an exact integer dot,
    then (sum * row scale) * channel scale in f32."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    xs = np.where(amax > 0, amax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(x / xs), -127, 127).astype(np.int64)
    acc = (xq @ values_t.astype(np.int64).T).astype(np.float32)
    return (acc * xs) * scales[None, :]


@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 1536), (2, 64, 7), (3, 96, 33), (5, 576, 200),
                                   (17, 128, 4), (40, 576, 203), (128, 256, 64)])
def test_products_equal_the_exact_integer_reference(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m // 2] = 0.0  # an all-zero row (a padded token) has scale 1 and gives zeros
    qw = quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.05), "w8a8")
    packed = cpu_kernels.pack(qw)
    assert packed.shape == (n, k) and packed.channel_axis == 0 and packed.kernel == cpu_kernels.MATMUL_TARGET
    got = np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), packed))
    want = _reference(x, np.asarray(packed.values), np.asarray(packed.scales))
    # The same f32 operations in the same order: equal bits, whichever thread took a column
    # (40 x 576 x 203 and 5 x 576 x 200 are over the size that splits columns across threads).
    np.testing.assert_array_equal(got, want)
    assert not got[m // 2].any()


def test_extreme_values_do_not_saturate():
    """|x|, |w| = 127 everywhere: the largest 16-bit pair sum (2 x 127 x 127 = 32258) must
    not saturate; with alternating signs the sums cancel exactly."""
    k = 576
    x = np.full((2, k), 3.0, np.float32)
    x[1, 1::2] = -3.0
    values = np.full((4, k), 127, np.int8)
    values[1] = -127
    values[2, ::2] = -127  # w2: -127 at even inputs, +127 at odd ones; w3 the opposite
    values[3, 1::2] = -127
    packed = QuantizedWeight(jnp.asarray(values), jnp.ones(4, jnp.float32), "w8a8", channel_axis=0,
                             kernel=cpu_kernels.MATMUL_TARGET)
    got = np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), packed))
    s = 3.0 / 127  # the rows' scale: every |x| is the row's max
    full = 127 * 127 * k * s
    np.testing.assert_allclose(got, [[full, -full, 0, 0], [0, 0, -full, full]], rtol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 9])
def test_kernel_agrees_with_xla_dot(m):
    """The XLA path (quantize_rows, int8 dot_general) and the kernel differ by at most float
    rounding, or one activation step where XLA's division lands a value the other side of
    a half (a step of the row is amax/127, times |w| summed over the channel)."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32))
    qw = quantize(jnp.asarray(rng.standard_normal((576, 300)).astype(np.float32) * 0.05), "w8a8")
    xla = np.asarray(jax.jit(quantized_matmul)(x, qw))
    kernel = np.asarray(jax.jit(quantized_matmul)(x, cpu_kernels.pack(qw)))
    step = np.abs(np.asarray(x)).max(axis=1, keepdims=True) / 127 * np.asarray(qw.scales)[None, :] * 127
    assert np.all(np.abs(kernel - xla) <= step + 1e-5 * np.abs(xla))
    assert np.median(np.abs(kernel - xla)) < 1e-5


def _head(model_or_state) -> QuantizedWeight:
    """The LM head of a model or its nnx state: `lm_head`, or `tied_lm_head` when tied."""
    name = "tied_lm_head" if "tied_lm_head" in dict(nnx.to_flat_state(nnx.state(model_or_state))) else "lm_head"
    node = model_or_state[name] if isinstance(model_or_state, nnx.State) else getattr(model_or_state, name)
    return node.get_value()


def test_pack_for_kernel_lays_out_every_packable_projection(tiny_llama):
    model = load_checkpoint(str(tiny_llama), quantization="w8a8").model
    packed = cpu_kernels.pack_for_kernel(model)
    layer = model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        qw = getattr(layer, name).get_value()
        assert (qw.kernel, qw.channel_axis) == (cpu_kernels.MATMUL_TARGET, 0), name
    assert _head(model).kernel == cpu_kernels.MATMUL_TARGET
    embed = model.embed.get_value()  # looked up by row, not multiplied: stays as it was
    assert embed.kernel is None and embed.channel_axis == 0
    # 7 projections per layer and the head; the embedding is not a projection.
    assert packed == 7 * model.cfg.num_layers + 1


def test_weights_the_kernel_cannot_take_keep_xla():
    odd = quantize(jnp.ones((48, 64)), "w8a8")  # 48 inputs: not a multiple of 32
    assert not cpu_kernels.packable(odd)
    assert not cpu_kernels.packable(quantize(jnp.ones((64, 64)), "int8"))  # weight-only mode
    assert not cpu_kernels.packable(quantize(jnp.ones((2, 64, 64)), "w8a8", channel_axis=2))  # expert stack
    assert cpu_kernels.packable(quantize(jnp.ones((64, 48)), "w8a8"))


def test_packed_model_logits_match_the_xla_path(tiny_llama):
    prompt = np.random.RandomState(11).randint(3, 300, 17).tolist()
    blocks = tuple(shuffled_blocks(3, 48, seed=12))
    xla = prompt_logits(load_checkpoint(str(tiny_llama), quantization="w8a8").model, prompt, blocks)
    model = load_checkpoint(str(tiny_llama), quantization="w8a8").model
    cpu_kernels.pack_for_kernel(model)
    got = prompt_logits(model, prompt, blocks)
    # Same integers and scales; the two paths differ only where an activation's division
    # rounds the other way (test_kernel_agrees_with_xla_dot), far under the quantization
    # error itself (tests/models/test_quant.py allows 13 % of the logits' spread against float32).
    assert np.abs(got - xla).max() < 0.01 * xla.std()
    assert (got.argmax(-1) == xla.argmax(-1)).all()


def test_mixed_workload_on_the_kernel_causes_zero_recompiles(tiny_llama):
    model = load_checkpoint(str(tiny_llama), quantization="w8a8").model
    cpu_kernels.pack_for_kernel(model)
    runner = ModelRunner(model, num_blocks=64, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128)
    runner.warmup()
    mixed_workload(runner)
    assert runner.recompiles_after_warmup == 0


@pytest.mark.parametrize("int8_kernel", ["auto", "xla"])
def test_engine_says_which_matmul_w8a8_runs_on(tiny_llama, int8_kernel):
    from ferrox_jax.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_llama), dtype="float32", quantization="w8a8",
                                      int8_kernel=int8_kernel, kv_blocks=32, max_context=128, max_seqs=2,
                                      prefill_chunk=16))
    try:
        note = engine.describe()["int8_matmul"]
        head = _head(engine._runner.state)
        if int8_kernel == "auto":
            assert note.startswith(f"w8a8 projections: {7 * engine.model_config.num_layers + 1} on the AVX2")
            assert head.kernel == cpu_kernels.MATMUL_TARGET
        else:
            assert note == "w8a8 projections: XLA's int8 dot (--int8-kernel xla)"
            assert head.kernel is None
    finally:
        engine.shutdown()


def test_engine_config_refuses_an_unknown_int8_kernel():
    with pytest.raises(ValueError, match="int8_kernel must be one of auto, xla; got 'avx512'"):
        EngineConfig(int8_kernel="avx512")


@pytest.mark.slow
def test_default_model_on_the_kernel_stays_within_the_w8a8_budget():
    from models.reference import kl_divergence as _kl
    from models.reference import log_softmax

    source, prompt, blocks, ref = default_model_case()
    xla = prompt_logits(source.build(quantization="w8a8"), prompt, blocks).astype(np.float64)
    model = source.build(quantization="w8a8")
    assert cpu_kernels.pack_for_kernel(model) == 7 * 30 + 1
    got = prompt_logits(model, prompt, blocks).astype(np.float64)
    # The w8a8 budget of tests/models/test_quant.py (mean KL 0.4 against float32; derived there).
    kl = _kl(log_softmax(ref), log_softmax(got)).mean()
    kl_xla = _kl(log_softmax(ref), log_softmax(xla)).mean()
    assert kl < 0.4, f"mean KL {kl:.3g}"
    # And no worse than XLA's w8a8 (measured: 0.074 vs 0.077). The two do not agree bit for
    # bit over 30 layers: re-quantizing the activations at every projection turns a 1-ulp
    # difference anywhere upstream into a whole int8 step, and XLA's own w8a8 moves by as
    # much when only the graph around it changes (packing layer 0's q_proj alone moves the
    # other, still-XLA projections' logits by a mean KL of 0.013), so the test bounds the
    # error against float32, which is what a user sees.
    assert kl < 1.25 * kl_xla + 0.01, f"kernel mean KL {kl:.3g} vs XLA's w8a8 {kl_xla:.3g}"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


# ---- decode attention ---------------------------------------------------------------------------

# The kernel's builds: the one this CPU runs (AVX-512 lone rows where it has AVX-512 and head_dim
# is a multiple of 16) and its AVX2 build forced, so that an AVX-512 host checks both.
BUILDS = pytest.mark.parametrize("avx2", [False, True], ids=["native", "avx2"])

def _random_cache(rng, kv_heads, blocks, block_size, head_dim, dtype):
    k = jnp.asarray(rng.standard_normal((kv_heads, blocks, block_size, head_dim)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((kv_heads, blocks, block_size, head_dim)).astype(np.float32))
    if dtype == jnp.bfloat16:  # the CPU storage of a bfloat16 cache: its words as uint16
        return tuple(jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16) for x in (k, v))
    if dtype == jnp.float16:  # and of a float16 cache: its words as int16
        return tuple(jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.int16) for x in (k, v))
    return k, v


# head_dim 56 and 40: value columns in pieces of 32 + 24 and 32 + 8 (each width its own tile);
# 32 / 8 heads (Llama 3.2 1B) and 8 / 2: four query heads a kv head, a 16-bit cache's values
# 16 columns at a time for all four. Blocks of 8 keep a run of 8 keys in one block (one table
# lookup a run); blocks of 12 do not (a lookup per key).
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 128), (6, 2, 56), (2, 2, 40),
                                                     (32, 8, 64), (8, 2, 48)])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_size", [8, 12])
@BUILDS
def test_decode_attention_matches_the_pure_jax_paged_attention(heads, kv_heads, head_dim, kv_dtype, block_size, avx2):
    from models.attention import paged_attention

    rng = np.random.default_rng(heads * head_dim)
    width = 16  # a table of 16 blocks: up to 128 (blocks of 8) or 192 keys
    k_cache, v_cache = _random_cache(rng, kv_heads, 60, block_size, head_dim, kv_dtype)
    lengths = [1, 7, 8, 9, 40, 128]  # within a block, at and across block edges, a full table
    tables = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):  # each row's blocks: distinct, shuffled, never the null block
        tables[i, : -(-n // block_size)] = rng.permutation(np.arange(1, 60))[: -(-n // block_size)]
    q = jnp.asarray(rng.standard_normal((len(lengths), 1, heads, head_dim)).astype(np.float32))
    positions = jnp.asarray(np.array(lengths, np.int32)[:, None] - 1)
    scale = head_dim ** -0.5
    want = jax.jit(paged_attention, static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables), positions, scale)
    got = jax.jit(cpu_attention.decode_attention(avx2), static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables),
                                                                            positions, scale)
    assert got.shape == want.shape == (len(lengths), 1, heads, head_dim) and got.dtype == jnp.float32
    # Both softmax in f32 over the same keys; they differ in summation order and exp's last
    # bits (an AVX2 polynomial here): a few ulp of outputs of magnitude ~1.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("bad_id", [60, 1 << 20, -1])
def test_a_block_id_outside_the_cache_is_an_error_not_a_read_past_it(bad_id):
    """The scheduler never hands out such an id; a tool once did (profile_step's tables past a
    smaller cache), and the kernel read past the cache's buffer until the process died."""
    rng = np.random.default_rng(3)
    k_cache, v_cache = _random_cache(rng, 2, 60, 8, 16, jnp.float16)  # blocks 0..59
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)).astype(np.float32))
    positions = jnp.asarray(np.array([[19], [7]], np.int32))  # row 0 reads 3 blocks, row 1 one
    run = jax.jit(cpu_attention.decode_attention(), static_argnums=(5,))
    tables = np.zeros((2, 4), np.int32)
    tables[0, :3], tables[1, 0] = (5, 6, 7), 9
    tables[1, 1:] = bad_id  # past row 1's length: never read, so not checked
    ok = run(q, k_cache, v_cache, jnp.asarray(tables), positions, 0.25)
    assert np.isfinite(np.asarray(ok)).all()
    tables[0, 2] = bad_id  # row 0's third block, which it reads
    with pytest.raises(Exception, match="a block id in a row's table is outside the cache"):
        jax.block_until_ready(run(q, k_cache, v_cache, jnp.asarray(tables), positions, 0.25))


@pytest.mark.parametrize("heads,kv_heads,head_dim,lengths", [
    (9, 3, 64, [1000]),  # one decoding row of the default model: 3 (row, kv head) pairs for the threads
    (9, 3, 64, [65, 300]),
    (4, 1, 128, [5, 700]),  # the short row's later pieces are empty
])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@BUILDS
def test_decode_attention_split_into_pieces_matches_the_pure_jax_paged_attention(heads, kv_heads, head_dim, lengths,
                                                                                  kv_dtype, avx2):
    # Fewer than 4 (row, kv head) pairs a thread: each pair's keys are cut into pieces of at
    # least 64 whose softmax sums are merged (decode_attention.cc, MergePieces).
    from models.attention import paged_attention

    rng = np.random.default_rng(sum(lengths))
    block_size, width, blocks = 16, 64, 80
    k_cache, v_cache = _random_cache(rng, kv_heads, blocks, block_size, head_dim, kv_dtype)
    tables = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[i, :used] = rng.permutation(np.arange(1, blocks))[:used]
    q = jnp.asarray(rng.standard_normal((len(lengths), 1, heads, head_dim)).astype(np.float32) * 3)  # peaked
    positions = jnp.asarray(np.array(lengths, np.int32)[:, None] - 1)
    scale = head_dim ** -0.5
    want = jax.jit(paged_attention, static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables), positions, scale)
    got = jax.jit(cpu_attention.decode_attention(avx2), static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables),
                                                                            positions, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


# heads / kv heads 3 (the default model), 4 (one pack of 4 query heads on AVX-512, 3 and 1 on
# AVX2), 7 (4 + 3; 3 + 3 + 1), 2 and 1; head_dim 56: value columns 32 + 24
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 16), (14, 2, 32), (4, 2, 56), (4, 4, 32)])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@BUILDS
def test_rows_sharing_a_block_table_match_the_pure_jax_paged_attention(heads, kv_heads, head_dim, kv_dtype, avx2):
    """Consecutive rows with one table (a speculating row's 1 + d tokens, a prompt chunk's
    tokens) walk their keys together in tiles with an online softmax (SharedRows in
    decode_attention_shared.inc); lone rows between them keep the Piece path."""
    from models.attention import paged_attention

    rng = np.random.default_rng(heads * head_dim + 1)
    block_size, width, blocks = 16, 16, 120
    k_cache, v_cache = _random_cache(rng, kv_heads, blocks, block_size, head_dim, kv_dtype)
    # (rows, first length): a lone long row, a verification of 1 + 3 tokens, a lone short
    # row, a 40-token chunk resuming at 61 (tiles partly visible), two one-key rows
    runs = [(1, 250), (4, 97), (1, 5), (40, 61), (2, 1)]
    shuffled = iter(rng.permutation(np.arange(1, blocks)))
    tables, lengths = [], []
    for count, length in runs:
        used = -(-(length + count - 1) // block_size)
        table = np.zeros(width, np.int32)
        table[:used] = [next(shuffled) for _ in range(used)]
        tables += [table] * count
        lengths += [length + i if length > 1 else 1 for i in range(count)]
    tables, lengths = np.stack(tables), np.array(lengths, np.int32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 1, heads, head_dim)).astype(np.float32) * 2)
    positions = jnp.asarray(lengths[:, None] - 1)
    scale = head_dim ** -0.5
    want = jax.jit(paged_attention, static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables), positions, scale)
    got = jax.jit(cpu_attention.decode_attention(avx2), static_argnums=(5,))(q, k_cache, v_cache, jnp.asarray(tables),
                                                                            positions, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_chunk_attention_matches_the_pure_jax_paged_attention(heads, kv_heads, head_dim, kv_dtype):
    """Several query tokens a row (prompt chunks): each token sees its
    causal prefix; a row from 0, one resuming at 37 (a chunk after a cached prefix), one
    with padding at its end, one all padding."""
    from models.attention import paged_attention

    rng = np.random.default_rng(head_dim)
    block_size, width, blocks, t = 8, 16, 60, 11
    k_cache, v_cache = _random_cache(rng, kv_heads, blocks, block_size, head_dim, kv_dtype)
    starts, real = [0, 37, 5, 0], [11, 11, 6, 0]
    tables = np.zeros((len(starts), width), np.int32)
    for i, (s0, n) in enumerate(zip(starts, real)):
        used = -(-(s0 + n) // block_size)
        tables[i, :used] = rng.permutation(np.arange(1, blocks))[:used]
    positions = np.array([[s0 + j for j in range(t)] for s0 in starts], np.int32)
    valid = np.array([[j < n for j in range(t)] for n in real])
    positions = np.where(valid, positions, 0)
    q = jnp.asarray(rng.standard_normal((len(starts), t, heads, head_dim)).astype(np.float32) * 2)
    scale = head_dim ** -0.5
    args = (q, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(positions))
    want = jax.jit(lambda *a: paged_attention(*a, scale, valid=jnp.asarray(valid)))(*args)
    got = jax.jit(lambda *a: cpu_attention.decode_attention().chunks(*a, jnp.asarray(valid), scale))(*args)
    assert got.shape == want.shape == (len(starts), t, heads, head_dim) and got.dtype == jnp.float32
    # real tokens as the pure-JAX path; padding tokens (whose outputs nothing reads) zeros
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=1e-5, atol=2e-6)
    assert not np.asarray(got)[~valid].any()


def test_decode_attention_is_chosen_on_cpu_where_it_can_run():
    from models.pallas_attention import select_decode_attention

    kw = dict(block_size=16, max_blocks_per_row=64, backend="cpu")
    attention, note = select_decode_attention("auto", head_dim=64, kv_dtype=jnp.float32, **kw)
    isa = "AVX-512" if cpu_kernels.attention_isa() == "AVX-512" else "AVX2"
    assert isinstance(attention, cpu_attention.CpuDecodeAttention) and f"ferrox's {isa} CPU kernel" in note
    _, note = select_decode_attention("auto", head_dim=40, kv_dtype=jnp.float32, **kw)  # not a multiple of 16
    assert "ferrox's AVX2 CPU kernel" in note
    assert select_decode_attention("jax", head_dim=64, kv_dtype=jnp.float32, **kw)[0] is None
    attention, note = select_decode_attention("auto", head_dim=12, kv_dtype=jnp.float32, **kw)
    assert attention is None and "head_dim 12 is not a multiple of 8" in note
    with pytest.raises(ValueError, match="attention_impl=cpu: .*head_dim 12 is not a multiple of 8"):
        select_decode_attention("cpu", head_dim=12, kv_dtype=jnp.float32, **kw)
    with pytest.raises(ValueError, match="attention_impl=cpu: .*backend tpu is not a CPU"):
        select_decode_attention("cpu", head_dim=64, kv_dtype=jnp.float32, block_size=16, max_blocks_per_row=64,
                                backend="tpu")


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_model_decode_steps_on_the_attention_kernel_match_pure_jax(tiny_llama, kv_dtype):
    """Two rows, a 17-token prompt each, then 6 one-token steps (T == 1: the kernel's path)."""
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 300, 17).tolist(), rng.randint(3, 300, 11).tolist()]
    blocks = shuffled_blocks(8, 48, seed=20)
    tables = [tuple(blocks[:4]), tuple(blocks[4:])]  # positions up to 22 need 3 blocks of 8
    steps = {}
    for attention in (None, cpu_attention.decode_attention()):
        model = load_checkpoint(str(tiny_llama), decode_attention=attention).model
        runner = ModelRunner(model, num_blocks=48, block_size=8, max_rows=4, max_chunk_tokens=32,
                             max_context=128, kv_dtype=kv_dtype)
        for prompt, table in zip(prompts, tables):
            runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=table, sample=False)])
        out = []
        for s in range(6):
            rows = [RowPlan(row_id=i, token_ids=(5 + s + i,), start_pos=len(p) + s, block_ids=t, sample=False)
                    for i, (p, t) in enumerate(zip(prompts, tables))]
            out.append(np.stack([x[0] for x in runner.run_logits(rows)]))
        steps[attention is None] = np.stack(out)
    np.testing.assert_allclose(steps[False], steps[True], rtol=1e-4, atol=1e-5)


def test_bench_tool_prints_both_sides_of_every_line(capsys):
    from tools.bench.bench_cpu_kernels import PRODUCTS, main

    main(["--only", "products", "--rows", "2", "--repeats", "1"])
    main(["--only", "attention", "--rows", "2", "--contexts", "8", "40", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(lines) == len(PRODUCTS) + 2 * 2  # every product; 2 contexts x 2 KV dtypes
    for line in lines:
        assert line.rstrip().endswith("× |") and "nan" not in line
