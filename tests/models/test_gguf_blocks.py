"""`--quantization gguf`: a GGUF's Q4_0 / Q4_1 / Q8_0 / K-quant projections served as their blocks.

The tiny GGUF of tests/models/test_gguf_loader.py mixes Q4_0, Q4_1, Q8_0, K-quant and float
projections over 3 layers and writes llama's q/k rows permuted, so one file checks the
placement of each kind, the row un-permutation and the tied head made from the Q8_0
embedding. The float model of the same file (its blocks dequantized) is the reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ferrox_jax.config import EngineConfig
from ferrox_jax.runner import ModelRunner
from models import cpu_kernels
from models.gguf_blocks import BlockQuantizedWeight
from models.loader import open_checkpoint
from tests.support.engine_helpers import prompt_logits, shuffled_blocks
from tests.support.sharding_probe import mixed_workload
from tests.models.test_gguf_loader import D, H, HD, LAYER_TYPES, write_tiny_gguf

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("blocks") / "tiny-mixed.gguf"
    write_tiny_gguf(path, tied=True)
    return open_checkpoint(str(path))


@pytest.fixture(scope="module")
def float_logits(tiny_gguf):
    prompt = np.random.RandomState(5).randint(0, 28, 17).tolist()  # 17 = 2 blocks of 8 + 1
    blocks = tuple(shuffled_blocks(3, 48, seed=6))
    return prompt, blocks, prompt_logits(tiny_gguf.build(), prompt, blocks).astype(np.float64)


def test_block_formats_are_kept_and_the_rest_is_float(tiny_gguf):
    model = tiny_gguf.build(quantization="gguf")
    layer0 = model.layers[0]
    # layer 0: attn_q Q4_0, attn_k Q4_1, ffn_gate Q8_0, ffn_down Q4_K (tests/models/test_gguf_kquants.py);
    # attn_v F16 stays float
    for proj, fmt in ((layer0.q_proj, "q4_0"), (layer0.k_proj, "q4_1"), (layer0.gate_proj, "q8_0"),
                      (layer0.down_proj, "q4_k"), (model.layers[1].down_proj, "q5_k"),
                      (model.layers[2].down_proj, "q6_k")):
        w = proj.get_value()
        assert isinstance(w, BlockQuantizedWeight) and w.fmt == fmt, f"{fmt} projection kept as blocks"
    assert layer0.q_proj.get_value().shape == (D, H * HD), "the projection's logical [in, out]"
    assert not isinstance(layer0.v_proj.get_value(), BlockQuantizedWeight), "F16 stays float"
    head = model.tied_lm_head.get_value()
    assert isinstance(head, BlockQuantizedWeight) and head.fmt == "q8_0", "tied head from the Q8_0 embedding"
    assert head.shape == (model.cfg.hidden_size, model.cfg.vocab_size)
    table = model.embed.get_value()
    assert isinstance(table, BlockQuantizedWeight) and table.blocks is head.blocks, \
        "the lookup table is the embedding's blocks, one array with the tied head (no float32 copy)"


def test_the_embedding_lookup_from_blocks_equals_the_float_tables_rows(tiny_gguf):
    """Rows gathered from the blocks and dequantized are the float model's table rows (the
    file's blocks dequantized at load) exactly; a lookup of the wrong rows would differ."""
    tokens = jnp.asarray([[0, 27, 5], [5, 1, 26]])
    table = np.asarray(tiny_gguf.build().embed.get_value())
    got = np.asarray(tiny_gguf.build(quantization="gguf").embed_tokens(tokens))
    assert got.shape == (2, 3, table.shape[1]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, table[np.asarray(tokens)])
    assert not np.array_equal(got, table[(np.asarray(tokens) + 1) % table.shape[0]]), "rows differ token to token"


def test_xla_path_logits_equal_the_dequantized_float_model(tiny_gguf, float_logits):
    prompt, blocks, ref = float_logits
    got = prompt_logits(tiny_gguf.build(quantization="gguf"), prompt, blocks)
    # Same weights (the blocks dequantized), same float32 products but in another order:
    # float32 rounding only, ~1e-6 of logits of spread ~0.1 through 3 layers.
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


@needs_kernels
def test_kernel_float_path_logits_equal_the_dequantized_float_model(tiny_gguf, float_logits):
    prompt, blocks, ref = float_logits
    model = tiny_gguf.build(quantization="gguf")
    kept = sum(t in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K) for layer in LAYER_TYPES for t in layer.values())
    assert cpu_kernels.pack_blocks_for_kernel(model, int_rows=0, amx_rows=0, wide_rows=0) == kept + 1, \
        "every block projection + the head (the embedding table is looked up, not counted)"
    got = prompt_logits(model, prompt, blocks)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), "float path: float32 rounding only"


@needs_kernels
def test_default_pack_puts_only_weights_of_many_inputs_on_the_tiles(tiny_gguf, monkeypatch):
    # The default (amx_rows=None) gives AMX tiles only to weights of BLOCK_AMX_MIN_K inputs or
    # more (measured: narrower ones lose whole steps to the 16-bit path); an explicit amx_rows
    # applies to every weight. Set up as an AMX host would be, on any CPU: the rule is the
    # pack's. The tiny file's Q4_0 / Q4_1 / Q8_0 weights all have D inputs: a bound of D takes
    # them, D + 1 leaves them; K-quants (their own kernel) never take the tiles.
    monkeypatch.setattr(cpu_kernels, "block_amx_rows", lambda: 128)
    model = tiny_gguf.build(quantization="gguf")
    tiled = ("q4_0", "q4_1", "q8_0")  # the block kernel's formats, the ones the tiles can take

    def amx_rows_of_blocks():
        found = {}
        for i, layer in enumerate(model.layers):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                w = getattr(layer, name).get_value()
                if isinstance(w, BlockQuantizedWeight):
                    found[(i, name, w.fmt, w.in_features)] = w.amx_rows
        return found

    for bound, want in ((D, 128), (D + 1, 0)):
        monkeypatch.setattr(cpu_kernels, "BLOCK_AMX_MIN_K", bound)
        cpu_kernels.pack_blocks_for_kernel(model)
        found = amx_rows_of_blocks()
        blocks = {key: rows for key, rows in found.items() if key[2] in tiled}
        assert len(blocks) >= 10 and all(key[3] == D for key in blocks)
        assert set(blocks.values()) == {want}, (bound, blocks)
        assert {rows for key, rows in found.items() if key not in blocks} == {0}, "K-quants: no tiles"
    cpu_kernels.pack_blocks_for_kernel(model, amx_rows=7)
    assert {rows for key, rows in amx_rows_of_blocks().items() if key[2] in tiled} == {7}, \
        "an explicit amx_rows applies to every block weight"


@pytest.mark.skipif(cpu_kernels.block_isa() != "AVX-512 VNNI", reason="the 16-bit path is AVX-512 VNNI only")
def test_kernel_wide_path_logits_stay_within_int16_activation_rounding(tiny_gguf, float_logits):
    prompt, blocks, ref = float_logits
    model = tiny_gguf.build(quantization="gguf")
    cpu_kernels.pack_blocks_for_kernel(model, int_rows=0, amx_rows=0, wide_rows=1)
    err = np.abs(prompt_logits(model, prompt, blocks) - ref).max()
    cpu_kernels.pack_blocks_for_kernel(model, int_rows=0, amx_rows=0, wide_rows=0)
    float_err = np.abs(prompt_logits(model, prompt, blocks) - ref).max()
    # int16 activation blocks err by amax / 65534 a value at most, 1/258 of the int8 path's
    # step (measured here: 0.14 % of the spread, the int8 path 10 %, the float path 6e-6);
    # bound it by 0.4 % (the float16 KV cache's bound), and it must be well off float32's
    # rounding (the path ran)
    assert err < 4e-3 * ref.std(), f"16-bit path: max |Δlogit| {err:.3g} vs spread {ref.std():.3g}"
    assert err > 3 * float_err, f"16-bit path ({err:.3g}) not off the float path ({float_err:.3g})"


@pytest.mark.skipif(not cpu_kernels.block_amx(), reason="no AMX-BF16 on this CPU / OS")
def test_kernel_amx_path_logits_stay_within_split_bf16_rounding(tiny_gguf, float_logits):
    prompt, blocks, ref = float_logits
    model = tiny_gguf.build(quantization="gguf")
    cpu_kernels.pack_blocks_for_kernel(model, int_rows=0, amx_rows=1, wide_rows=0)
    got = prompt_logits(model, prompt, blocks)
    # hi + lo bf16 operands: ~2^-15 of each product, 13 products in series: ~1e-4 of the
    # logits; far below the integer path's ~10 % and above float32's rounding
    assert np.abs(got - ref).max() < 1e-3 * max(1.0, np.abs(ref).max()), "AMX path: split-bf16 rounding only"


@needs_kernels
def test_kernel_integer_path_stays_within_activation_rounding(tiny_gguf, float_logits):
    prompt, blocks, ref = float_logits
    model = tiny_gguf.build(quantization="gguf")
    cpu_kernels.pack_blocks_for_kernel(model, int_rows=1, amx_rows=0)
    got = prompt_logits(model, prompt, blocks)
    # 32-wide int8 activation blocks err by amax/440 rms per value, ~0.6 % of a product's
    # spread (amax/rms ~2.5 over 32 normal values); 13 products in series add in quadrature
    # to ~2.1 %, and the largest of 17 x 28 errors lies within ~4.5 standard deviations:
    # ~10 % of the spread; bound it by 15 %.
    err = np.abs(got - ref).max()
    assert 0 < err < 0.15 * ref.std(), f"integer path: max |Δlogit| {err:.3g} vs spread {ref.std():.3g}"
    # and below w8a8's (one activation scale per row, weights requantized per channel)
    w8a8 = np.abs(prompt_logits(tiny_gguf.build(quantization="w8a8"), prompt, blocks) - ref).max()
    assert err < w8a8, f"32-wide activation blocks ({err:.3g}) beat per-row scales ({w8a8:.3g})"


@needs_kernels
def test_mixed_workload_after_warmup_causes_zero_recompiles(tiny_gguf):
    model = tiny_gguf.build(quantization="gguf")
    cpu_kernels.pack_blocks_for_kernel(model, int_rows=3, amx_rows=4, wide_rows=2)  # every path in one workload
    runner = ModelRunner(model, num_blocks=64, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128)
    runner.warmup()
    mixed_workload(runner)
    assert runner.recompiles_after_warmup == 0


def test_engine_resolves_auto_and_reports_the_kernel(tiny_gguf):
    from ferrox_jax.engine import Engine

    engine = Engine.load(EngineConfig(model=tiny_gguf.path, dtype="float32", quantization="auto", kv_blocks=32,
                                      max_context=128, max_seqs=2, prefill_chunk=16))
    try:
        card = engine.model_card
        if cpu_kernels.unavailable_reason() is None:
            assert card.quantization == "gguf", "auto serves a quantized GGUF's own blocks on one CPU device"
            assert cpu_kernels.block_isa() in card.matmul, "the card names the block kernel's ISA"
            assert card.kv_cache_dtype == "float16", "the gguf mode keeps a float16 KV cache, as llama.cpp does"
            assert engine.runner.kv_cache.k[0].dtype == jnp.int16, "its words held as int16 on CPU"
        else:
            assert (card.quantization, card.kv_cache_dtype) == ("none", "float32")
    finally:
        engine.shutdown()


def test_an_explicit_kv_cache_dtype_overrides_the_gguf_default(tiny_gguf):
    from ferrox_jax.engine import Engine

    engine = Engine.load(EngineConfig(model=tiny_gguf.path, dtype="float32", quantization="gguf", kv_blocks=32,
                                      max_context=128, max_seqs=2, prefill_chunk=16, kv_cache_dtype="float32"))
    try:
        assert engine.model_card.kv_cache_dtype == "float32"
    finally:
        engine.shutdown()
