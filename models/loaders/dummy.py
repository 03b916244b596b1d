"""Synthetic weights (`--load-format dummy`): a checkpoint's shapes served with random weights.

What it is for: sizing and benchmarking a deployment (an 8B or 70B shape) before any
weights are downloaded. Only the config is read: an HF folder's `config.json` (no
`.safetensors` needed) or a GGUF file's metadata. The outputs are meaningless; the
engine says so at start-up (a WARNING), in `/health` and in `/metrics`.

Weights are made ON THE DEVICE, in the target dtype, one parameter at a time: each is a
jitted initialiser whose `out_shardings` is the parameter's sharding (the engine passes
`placement(name, shape)` on a mesh), so a 70B shape never materialises on the host and
each device generates only its own shards (JAX's threefry is partitionable, so the values
do not depend on the sharding). One initialiser is compiled per distinct (shape, dtype,
scale, sharding), so the 32 layers of a Llama share ~10 compiles.

Deterministic: parameter `name` gets `fold_in(key(seed), crc32(name))`, so the same seed
gives the same weights whatever the order, sharding or backend's PRNG placement.

Scale (every matrix `normal(0, std)`; norms 1, biases 0), so activations stay O(1) through
any depth in bf16:

    embed [V, D]                     std = D^-1/2   (tied or not, logits = h @ W has unit variance)
    lm_head [D, V]                   std = D^-1/2
    q/k/v_proj, gate/up_proj [D, *]  std = D^-1/2   (unit-RMS input from the norm -> unit variance)
    o_proj [H*hd, D]                 std = (H*hd)^-1/2 / sqrt(2L)
    down_proj [F, D]                 std = F^-1/2 / sqrt(2L)

The residual branches are scaled by 1/sqrt(2L) (GPT-2's residual scaling): each of the
2L branches adds at most ~1/(2L) of variance to the residual stream, so after L layers
it has variance ~1 instead of ~2L, and the logits keep unit variance at 1 layer or 80.

Tokenizer: the folder's `tokenizer.json` when present; otherwise a byte-level fallback
built here (`byte_fallback_tokenizer`): ids 0-255 are the 256 bytes, every other id up to
`vocab_size` a plain token `<|tok_N|>`, and the config's eos ids its stop tokens. Text
round-trips byte for byte; generated ids above 255 decode as their `<|tok_N|>` names.
"""

from __future__ import annotations

import functools
import logging
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.checkpoint import CheckpointSource
from models.config import ModelConfig
from models.decoder import CausalLM
from models.loaders.common import abstract_model, param_name
from models.quant import INT8_MODES, check_mode, quantize, quantized_channel_axis, tied_head
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# name -> sharding (or None) for one parameter; the engine's, on a mesh
Placement = Callable[[str, tuple[int, ...]], Any]


RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "experts_down")  # projections adding into the residual stream


def init_std(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> float | None:
    """The normal std of parameter `name` of `shape`; None for norms and biases (constants).

    Fan-in scaling (`in^-1/2` for an `[..., in, out]` weight; the embedding's rows are
    `D^-1/2` long), and the projections that add into the residual stream are further
    divided by sqrt(2 * layers), so activations stay near unit scale at any depth.
    """
    leaf = name.split(".")[-1]
    if leaf.endswith("norm") or leaf.endswith("bias"):
        return None
    fan_in = cfg.hidden_size if leaf == "embed" else shape[-2]
    std = fan_in ** -0.5
    if leaf in RESIDUAL_OUTPUTS:
        std *= (2 * cfg.num_layers) ** -0.5
    return std


def neutral_norm_weight(cfg: ModelConfig) -> float:
    """The norm weight that scales by one: 1 for Llama's `w * x`, 0 for Gemma's `(1 + w) * x`
    (the offset llama.cpp's converter adds to Gemma norms, `Family.gguf_norm_offset`)."""
    from models.registry import family_for

    return 1.0 - family_for(cfg.architecture).gguf_norm_offset


@functools.lru_cache(maxsize=None)
def _initializer(shape: tuple[int, ...], dtype: str, std: float | None, fill: float, sharding: Any) -> Callable:
    """A jitted `(seed, salt) -> dtype[shape]` made directly with `sharding` (None: the
    default device). The key is derived inside, so making a parameter is one dispatch."""

    def make(seed, salt):
        if std is None:
            return jnp.full(shape, fill, dtype)
        key = jax.random.fold_in(jax.random.key(seed), salt)
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _quantizer(mode: str, channel_axis: int) -> Callable:
    """A jitted float weight -> QuantizedWeight (`models/quant.py`), on the weight's devices."""
    return jax.jit(functools.partial(quantize, mode=mode, channel_axis=channel_axis))


def param_salt(name: str) -> np.uint32:
    """What parameter `name`'s key folds into the seed's: its own, independent of order."""
    return np.uint32(zlib.crc32(name.encode()))


def build_dummy_model(cfg: ModelConfig, dtype, seed: int, *, decode_attention: Any = None,
                      progress: Callable[[str], None] | None = None,
                      placement: Placement | None = None, quantization: str = "none") -> CausalLM:
    """A model of `cfg`'s shapes with random weights made on the device (module docstring).

    Args:
      dtype: parameter dtype (generated in f32, cast on the device).
      seed: same seed, same weights.
      decode_attention: as for `CheckpointSource.build`.
      progress: called with each parameter's name once made.
      placement: `placement(name, shape)` -> the parameter's sharding; None: default device.
      quantization: "none", "int8" or "w8a8": the weights `build_model` would quantize are
        made in float, then quantized on the device one at a time.
    """
    check_mode(quantization)
    model = abstract_model(cfg, dtype, decode_attention)
    state = nnx.state(model, nnx.Param)
    dtype_name = jnp.dtype(dtype).name
    norm_fill = neutral_norm_weight(cfg)
    for path, variable in nnx.to_flat_state(state):
        name = param_name(path)
        shape = tuple(variable.shape)
        std = init_std(name, shape, cfg)
        fill = norm_fill if name.endswith("norm") else 0.0
        sharding = placement(name, shape) if placement is not None else None
        make = _initializer(shape, dtype_name, std, fill, sharding)
        value = make(np.uint32(seed), param_salt(name))
        axis = quantized_channel_axis(name, shape) if quantization in INT8_MODES else None  # gguf: float
        variable.set_value(value if axis is None else _quantizer(quantization, axis)(value))
        if progress:
            progress(name)
    nnx.update(model, state)
    # As in `build_model`: a tied model keeps a transposed copy of the embedding (made on the
    # device from the device array).
    if cfg.tie_word_embeddings:
        model.tied_lm_head = nnx.Variable(tied_head(model.embed.get_value()))
    return model


# ---------------------------------------------------------------- tokenizer

BYTE_TOKENS = 256


def _byte_level_chars() -> list[str]:
    """The 256 characters byte-level BPE writes bytes 0..255 as (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(BYTE_TOKENS):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTE_TOKENS + extra)
            extra += 1
    return [chars[b] for b in range(BYTE_TOKENS)]


def byte_fallback_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """A byte-level tokenizer covering every id of `cfg.vocab_size` (module docstring).

    Raises:
      ValueError when the vocabulary has fewer than 256 ids (no room for the bytes).
    """
    from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

    if cfg.vocab_size < BYTE_TOKENS:
        raise ValueError(f"vocab_size {cfg.vocab_size} < {BYTE_TOKENS}: the byte-level fallback tokenizer needs "
                         f"an id per byte; put the checkpoint's tokenizer.json beside config.json")
    vocab = {ch: i for i, ch in enumerate(_byte_level_chars())}
    vocab.update({f"<|tok_{i}|>": i for i in range(BYTE_TOKENS, cfg.vocab_size)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    stops = [i for i in cfg.eos_token_ids if BYTE_TOKENS <= i < cfg.vocab_size]
    # Existing vocabulary entries marked special: decode skips them, the tokenizer stops on them.
    backend.add_special_tokens([AddedToken(f"<|tok_{i}|>", special=True) for i in stops])
    return Tokenizer(backend, eos_token_id=stops[0] if stops else None, bos_token_id=None,
                     extra_stop_token_ids=stops)


def open_dummy(path: Path, seed: int) -> CheckpointSource:
    """A `CheckpointSource` over `path`'s config (HF folder or GGUF) that builds random weights."""
    if path.is_dir():
        from models.loaders.safetensors import read_config

        cfg = read_config(path)
        if (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_hf_dir(path)
        else:
            log.warning("no tokenizer.json in %s: using a byte-level fallback tokenizer "
                        "(256 byte ids, the other %d ids named <|tok_N|>)", path, cfg.vocab_size - BYTE_TOKENS)
            tokenizer = byte_fallback_tokenizer(cfg)
        name = path.name
    elif path.suffix == ".gguf":
        from models.loaders.gguf import open_gguf_checkpoint

        cfg, _, tokenizer, _ = open_gguf_checkpoint(path)  # metadata only; its tensors are never read
        name = path.stem
    else:
        raise ValueError(f"unrecognised model path {path}: expected a folder with config.json or a .gguf file")

    def build(dtype, *, decode_attention=None, progress=None, placement=None, quantization="none"):
        return build_dummy_model(cfg, dtype, seed, decode_attention=decode_attention, progress=progress,
                                 placement=placement, quantization=quantization)

    return CheckpointSource(cfg, tokenizer, name, str(path), {}, builder=build, is_synthetic=True)

