"""Tiny random PEFT LoRA adapters for tests, their llama.cpp GGUF form (`peft_to_gguf`, as
convert_lora_to_gguf.py writes it, Qwen3.5's and Qwen3-Next's DeltaNet tensors included), and a
runner with adapter slots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's modules



def _hf_config(name: str, **fields):
    """transformers.<name>(**fields), imported on use: the sharding probe's subprocess
    imports this module and needs no transformers."""
    import transformers

    return getattr(transformers, name)(**fields)


# Tiny configs (2 layers, hidden 64) the LoRA tests share.
CONFIGS = {
    "llama": lambda: _hf_config("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                tie_word_embeddings=False),
    "qwen3": lambda: _hf_config("Qwen3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                max_position_embeddings=512, tie_word_embeddings=False),
    "gemma2": lambda: _hf_config("Gemma2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=12,
                                 attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
    "phi3": lambda: _hf_config("Phi3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               tie_word_embeddings=False),
}


def make_peft_adapter(base: Path, out: Path, seed: int, r: int = 4, alpha: float = 8.0,
                      targets=tuple(ALL_TARGETS), use_rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter for the HF checkpoint `base` under `out`, with random A and
    non-zero B (`init_lora_weights=False`: PEFT's default B is zeros, an adapter that
    changes nothing and would make every parity check pass trivially)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf, config)
    model.save_pretrained(out)
    return out


def peft_models(base: Path, adapter: Path):
    """(unmerged PeftModel, merged plain model) for `adapter` on `base`, float32, eval."""
    import peft
    import torch
    import transformers

    def fresh():
        return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    unmerged = peft.PeftModel.from_pretrained(fresh(), adapter).eval()
    merged = peft.PeftModel.from_pretrained(fresh(), adapter).merge_and_unload().eval()
    return unmerged, merged


def lora_runner(path, max_loras: int = 2, max_rank: int = 8, **runner_kwargs):
    """(runner, registry, checkpoint) over `path` with `max_loras` adapter slots of rank <= `max_rank`."""
    from ferrox_jax.lora_registry import LoraRegistry
    from ferrox_jax.runner import ModelRunner
    from models.registry import family_for
    from models.loader import load_checkpoint
    from models.lora import LoraSlots, attach_lora

    ckpt = load_checkpoint(str(path))
    slots = LoraSlots(max_loras, max_rank)
    targets = attach_lora(ckpt.model, slots)
    kwargs = dict(num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=16, max_context=128)
    kwargs.update(runner_kwargs)
    runner = ModelRunner(ckpt.model, **kwargs)
    registry = LoraRegistry(runner, slots, family_for(ckpt.config.architecture).hf_layer_weights, targets,
                            ckpt.config)
    return runner, registry, ckpt


# PEFT module (after model.layers.{i}.) -> llama.cpp's GGUF base tensor (after blk.{i}.),
# as convert_hf_to_gguf names them (gguf.constants' tensor tables; Qwen3.5's and Qwen3-Next's
# DeltaNet projections as conversion/qwen.py writes them).
_PEFT_TO_GGUF = {
    "self_attn.q_proj": "attn_q.weight", "self_attn.k_proj": "attn_k.weight", "self_attn.v_proj": "attn_v.weight",
    "self_attn.qkv_proj": "attn_qkv.weight", "self_attn.o_proj": "attn_output.weight",
    "mlp.gate_proj": "ffn_gate.weight", "mlp.up_proj": "ffn_up.weight", "mlp.gate_up_proj": "ffn_up.weight",
    "mlp.down_proj": "ffn_down.weight",
    "linear_attn.in_proj_qkv": "attn_qkv.weight", "linear_attn.in_proj_z": "attn_gate.weight",
    "linear_attn.in_proj_b": "ssm_beta.weight", "linear_attn.in_proj_a": "ssm_alpha.weight",
    "linear_attn.out_proj": "ssm_out.weight", "linear_attn.in_proj_ba": "ssm_ba.weight",
}
# The DeltaNet tensors whose value heads the converter tiles for qwen35 / qwen35moe
# (`_LinearAttentionVReorderBase`): which of lora_a / lora_b moves, along which axis, the head
# size ("dv" or 1) and the rows left in place ahead of the v heads (attn_qkv's q and k)
_TILED = {"attn_qkv.weight": ("B", 0, "dv", "qk"), "attn_gate.weight": ("B", 0, "dv", None),
          "ssm_beta.weight": ("B", 0, 1, None), "ssm_alpha.weight": ("B", 0, 1, None),
          "ssm_out.weight": ("A", 1, "dv", None)}


def _llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute on [out, ...] rows: rotate-half -> interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tile_v_heads(w: np.ndarray, axis: int, hk: int, per_k: int, head_dim: int, skip: int) -> np.ndarray:
    """The converter's `_reorder_v_heads` on a LoRA factor: the value heads past `skip` along
    `axis` from grouped by k head ([hk, per_k, head_dim]) to tiled ([per_k, hk, head_dim]), by
    the same index it builds (`idx.permute(1, 0, 2)`)."""
    n = w.shape[axis] - skip
    idx = np.arange(n).reshape(hk, per_k, head_dim).transpose(1, 0, 2).reshape(n)
    return np.take(w, np.concatenate([np.arange(skip), skip + idx]), axis=axis)


def _deltanet_pairs(module: str, pair: dict, arch: str, deltanet: dict, tile: bool):
    """[(GGUF base name, {"a", "b"})] for one DeltaNet module's (lora_A, lora_B), as conversion/qwen.py
    writes it: qwen35 / qwen35moe tile the value heads (`_TILED`); qwen3next splits in_proj_qkvz's
    rows into attn_qkv (q | k | v of every k head) and attn_gate (z), both with its lora_A."""
    hk, hv, dk, dv = (deltanet[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                             "linear_value_head_dim"))
    a, b = pair["A"], pair["B"]
    if module == "linear_attn.in_proj_qkvz":
        group = b.reshape(hk, 2 * dk + 2 * (hv // hk) * dv, -1)
        q, k, v, z = np.split(group, np.cumsum([dk, dk, hv // hk * dv]), axis=1)
        qkv = np.concatenate([part.reshape(-1, b.shape[1]) for part in (q, k, v)])
        return [("attn_qkv.weight", {"a": a, "b": qkv}), ("attn_gate.weight", {"a": a, "b": z.reshape(-1, b.shape[1])})]
    base = _PEFT_TO_GGUF[module]
    if tile and arch in ("qwen35", "qwen35moe") and hv != hk and base in _TILED:
        which, axis, head, skip = _TILED[base]
        factor = {"A": a, "B": b}[which]
        factor = _tile_v_heads(factor, axis, hk, hv // hk, dv if head == "dv" else 1, 2 * hk * dk if skip else 0)
        a, b = (factor, b) if which == "A" else (a, factor)
    return [(base, {"a": a, "b": b})]


def peft_to_gguf(adapter: Path, out: Path, arch: str, num_heads: int, num_kv_heads: int,
                 permute_qk: bool = True, deltanet: dict | None = None, tile_v_heads: bool = True,
                 rename: dict[str, str] | None = None) -> Path:
    """Write a PEFT adapter as llama.cpp's convert_lora_to_gguf.py does (f32 outtype):
    general.type "adapter", adapter.type "lora", adapter.lora.alpha = lora_alpha (use_rslora
    is not carried), tensors blk.{i}.{base}.lora_a = lora_A [r, in] and .lora_b = lora_B
    [out, r] as stored (ggml ne [in, r] and [r, out]), after the base model's own tensor edits:
    for `llama` the q/k permutation, which moves only lora_b's rows (`permute_qk=False` skips it:
    a negative control); for Qwen3.5's DeltaNet tensors (`deltanet`: the HF config's
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)
    the value heads tiled (`_TILED`; `tile_v_heads=False` skips it), for Qwen3-Next's fused
    in_proj_qkvz the split into attn_qkv and attn_gate. `rename` writes a GGUF base name under
    another (a negative control: a tensor on the wrong projection)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    pairs: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for key, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        layer, rest = key.removeprefix("base_model.model.model.layers.").split(".", 1)
        module, which = rest.rsplit(".lora_", 1)
        pairs.setdefault((layer, module), {})[which[0]] = tensor.astype(np.float32)
    for (layer, module), pair in pairs.items():
        if module.startswith("linear_attn."):
            named = _deltanet_pairs(module, pair, arch, deltanet, tile_v_heads)
        else:
            base, b = _PEFT_TO_GGUF[module], pair["B"]
            if permute_qk and arch == "llama" and base in ("attn_q.weight", "attn_k.weight"):
                b = _llama_permute(b, num_heads if base == "attn_q.weight" else num_kv_heads)
            named = [(base, {"a": pair["A"], "b": b})]
        for base, ab in named:
            base = (rename or {}).get(base, base)
            for which in ("a", "b"):
                writer.add_tensor(f"blk.{layer}.{base}.lora_{which}", np.ascontiguousarray(ab[which]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
