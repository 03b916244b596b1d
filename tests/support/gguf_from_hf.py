"""A tiny HF checkpoint written as a float32 GGUF the way llama.cpp's convert_hf_to_gguf.py
writes these architectures, so the GGUF loader can be checked against transformers.

What the converter does, per architecture (and what the loader must undo):
- names: `blk.{i}.<gguf name>` from the HF per-layer names (`gguf.constants` tables);
- qwen3/gemma2/gemma3/phi3 rows are written unpermuted (llama.cpp uses rotate-half RoPE
  for them; only `llama` files are permuted);
- gemma2/gemma3: every `*norm.weight` is stored as 1 + w;
- phi3: `qkv_proj` and `gate_up_proj` stay fused as `attn_qkv` / `ffn_up`; longrope
  factors become the tensors `rope_factors_short/long.weight` with the attention factor
  and the original context as metadata.
- llama (Mixtral too: llama.cpp writes it as `llama`): q/k rows permuted from rotate-half
  into interleaved order (`LlamaModel.permute`);
- experts (Mixtral, written `llama`; Qwen3-MoE, `qwen3moe`): `expert_count`,
  `expert_used_count` (+ `expert_feed_forward_length` for qwen3moe) as metadata, the router
  as `ffn_gate_inp`, and each layer's per-expert tensors stacked along a new first axis
  into `ffn_{gate,up,down}_exps` ([E, F, D], [E, F, D], [E, D, F] in HF's [out, in] order).
- gpt-oss (`gpt-oss`, `conversion/gpt_oss.py` for float experts): the fused, interleaved
  `gate_up_proj` [E, D, 2F] transposed and split into `ffn_gate_exps` (even columns) and
  `ffn_up_exps` (odd), `down_proj` [E, F, D] transposed to `ffn_down_exps`, their biases
  split likewise into `ffn_*_exps.bias`, sinks as `attn_sinks.weight`, the second norm as
  `post_attention_norm.weight`, the router (and its bias) as `ffn_gate_inp`; metadata
  adds the sliding window, `expert_feed_forward_length` and YaRN's `rope.scaling.*`.
- llama4 (`conversion/llama.py:Llama4Model`): q/k rows unpermuted (llama.cpp's rotation of
  adjacent pairs is HF's own), `feed_forward_length` the dense MLP's width
  (intermediate_size_mlp), `expert_feed_forward_length` the experts' (intermediate_size),
  `interleave_moe_layer_step`; the fused `gate_up_proj` [E, D, 2F] transposed and cut in
  halves into `ffn_gate_exps` / `ffn_up_exps`, `down_proj` [E, F, D] transposed to
  `ffn_down_exps`, the shared expert as `ffn_*_shexp`, the router as `ffn_gate_inp`. The
  converter writes no chunk size or temperature constants (llama.cpp fixes them at
  8192 / 8192 / 0.1); for a tiny model with other values we add them as
  `attention.sliding_window` / `attention.temperature_length` / `attention.temperature_scale`
  (models/llama4.py reads them), so its file computes what its HF checkpoint does.
The tokenizer is the checkpoint's byte-level BPE as `gpt2` tokens and merges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from safetensors.numpy import load_file

HF_TO_GGUF = {  # HF suffix after model.layers.{i}. -> GGUF suffix after blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
EXPERTS_TO_GGUF = {  # HF per-expert suffix (expert index as {e}) -> the stacked GGUF tensor
    "block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps.weight",
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
}
ROUTER_TO_GGUF = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "mlp.gate.weight": "ffn_gate_inp.weight"}
GPT_OSS_TO_GGUF = {
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
}
LLAMA4_TO_GGUF = {  # Llama 4's feed_forward.* names (its experts: _llama4_experts)
    "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight", "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "feed_forward.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
GEMMA_TO_GGUF = {  # where Gemma's sandwich norms differ
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_gguf(hf_dir: Path, out: Path, arch: str, quant: Callable[[str, np.ndarray], tuple] | None = None) -> Path:
    """`quant(gguf name, f32 array)`: (raw block bytes, GGMLQuantizationType) to write a 2-D or
    stacked 3-D (experts) tensor quantized, or None to keep it float32 (the default for every tensor)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    n_layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size_mlp"] if arch == "llama4" else cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size") or arch in ("gpt-oss", "llama4"):
            w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if arch == "llama4":
        _llama4_metadata(w, cfg)
    if arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    rope = cfg.get("rope_parameters") or {}
    is_gemma = arch in ("gemma2", "gemma3")
    if arch == "gemma3":
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotary)
    if is_gemma:
        w.add_sliding_window(cfg["sliding_window"])
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if arch == "gemma3":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "phi3":
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "longrope":
            original = cfg["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            w.add_rope_scaling_orig_ctx_len(original)
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    _add_tokenizer(w, hf_dir)

    def add(name: str, arr: np.ndarray, norm: bool = False):
        arr = np.ascontiguousarray(arr, np.float32)
        blocks = quant(name, arr) if quant is not None and arr.ndim >= 2 else None
        if blocks is not None:
            w.add_tensor(name, blocks[0], raw_dtype=blocks[1])
            return
        w.add_tensor(name, arr + 1.0 if (is_gemma and norm) else arr)

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"], norm=True)
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings"):
        add("output.weight", tensors["lm_head.weight"])
    table = {**HF_TO_GGUF, **ROUTER_TO_GGUF, **(GEMMA_TO_GGUF if is_gemma else {}),
             **(GPT_OSS_TO_GGUF if arch == "gpt-oss" else {}), **(LLAMA4_TO_GGUF if arch == "llama4" else {})}
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        stacks: dict[str, dict[int, np.ndarray]] = {}
        for name, arr in tensors.items():
            if not name.startswith(prefix):
                continue
            suffix = name[len(prefix):]
            if suffix.startswith("feed_forward.experts.") and arch == "llama4":
                for gguf_suffix, part in _llama4_experts(suffix, arr):
                    add(f"blk.{i}.{gguf_suffix}", part)
                continue
            if suffix.startswith("mlp.experts.") and arch == "gpt-oss":
                for gguf_suffix, part in _gpt_oss_experts(suffix, arr):
                    add(f"blk.{i}.{gguf_suffix}", part)
                continue
            expert = _expert_suffix(suffix)
            if expert is not None:
                stacks.setdefault(EXPERTS_TO_GGUF[expert[0]], {})[expert[1]] = arr
                continue
            if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                arr = _permute(arr, heads if suffix.startswith("self_attn.q") else cfg["num_key_value_heads"])
            add(f"blk.{i}.{table[suffix]}", arr, norm=suffix.endswith("norm.weight"))
        for gguf_name, by_expert in stacks.items():
            add(f"blk.{i}.{gguf_name}", np.stack([by_expert[e] for e in range(num_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gpt_oss_experts(suffix: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """gpt-oss's stacked expert tensors as llama.cpp's converter splits and transposes them."""
    if suffix == "mlp.experts.gate_up_proj":  # [E, D, 2F] -> [E, 2F, D], rows interleave gate/up
        rows = arr.swapaxes(-1, -2)
        return [("ffn_gate_exps.weight", rows[:, ::2]), ("ffn_up_exps.weight", rows[:, 1::2])]
    if suffix == "mlp.experts.gate_up_proj_bias":
        return [("ffn_gate_exps.bias", arr[..., ::2]), ("ffn_up_exps.bias", arr[..., 1::2])]
    if suffix == "mlp.experts.down_proj":
        return [("ffn_down_exps.weight", arr.swapaxes(-1, -2))]
    assert suffix == "mlp.experts.down_proj_bias", suffix
    return [("ffn_down_exps.bias", arr)]


def _llama4_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """Llama 4's keys: the MoE step, and (not the converter's: module docstring) the chunk size
    and temperature constants where they differ from the ones llama.cpp fixes."""
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    if all(t == "full_attention" for t in cfg.get("layer_types") or ()):
        w.add_sliding_window(0)
    elif cfg["attention_chunk_size"] != 8192:
        w.add_sliding_window(cfg["attention_chunk_size"])
    if cfg["floor_scale"] != 8192:
        w.add_uint32("llama4.attention.temperature_length", int(cfg["floor_scale"]))
    if cfg["attn_scale"] != 0.1:
        w.add_float32("llama4.attention.temperature_scale", float(cfg["attn_scale"]))


def _llama4_experts(suffix: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Llama 4's stacked expert tensors as llama.cpp's converter transposes and splits them."""
    rows = arr.swapaxes(-1, -2)  # [E, D, 2F] -> [E, 2F, D]; [E, F, D] -> [E, D, F]
    if suffix == "feed_forward.experts.gate_up_proj":  # gate rows first, then up
        half = rows.shape[1] // 2
        return [("ffn_gate_exps.weight", rows[:, :half]), ("ffn_up_exps.weight", rows[:, half:])]
    assert suffix == "feed_forward.experts.down_proj", suffix
    return [("ffn_down_exps.weight", rows)]


def _expert_suffix(suffix: str) -> tuple[str, int] | None:
    """(EXPERTS_TO_GGUF key, expert index) of a per-expert HF suffix, else None."""
    parts = suffix.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0 and parts[i - 1] == "experts":
            key = ".".join(parts[:i] + ["{e}"] + parts[i + 1:])
            return (key, int(part)) if key in EXPERTS_TO_GGUF else None
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from rotate-half into interleaved order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [None] * max(len(vocab), max(special.values(), default=-1) + 1)
    for text, i in {**vocab, **special}.items():  # added tokens past the BPE vocabulary too
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(special["<|im_end|>"])
    w.add_add_bos_token(False)


def write_gemma3_text_gguf(vlm_dir: Path, out: Path) -> Path:
    """The language model of a `Gemma3ForConditionalGeneration` folder as llama.cpp's converter
    writes it (`gemma3`, the text tensors only), through a text-only folder of its tensors."""
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    cfg = json.loads((vlm_dir / "config.json").read_text())
    text = {**cfg["text_config"], "architectures": ["Gemma3ForCausalLM"]}
    tensors = load_file(str(vlm_dir / "model.safetensors"))
    text_tensors = {}
    for k, v in tensors.items():  # saved as the Hub's `language_model.model.*` or `model.language_model.*`
        for prefix in ("language_model.model.", "model.language_model."):
            if k.startswith(prefix):
                text_tensors["model." + k[len(prefix):]] = v
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(text))
        save_file(text_tensors, str(folder / "model.safetensors"))
        shutil.copy(vlm_dir / "tokenizer.json", folder / "tokenizer.json")
        return write_gguf(folder, out, "gemma3")


MMPROJ_NAMES = {  # HF name after vision_tower. / multi_modal_projector. -> llama.cpp's mmproj name
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.patch_embedding.bias": "v.patch_embd.bias",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "post_layernorm.weight": "v.post_ln.weight", "post_layernorm.bias": "v.post_ln.bias",
    "mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight", "mm_input_projection_weight": "mm.input_projection.weight",
}
MMPROJ_LAYER = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up",
                "mlp.fc2": "ffn_down"}


def write_gemma3_mmproj(vlm_dir: Path, out: Path, f16: bool = True) -> Path:
    """The vision tower and projector of a `Gemma3ForConditionalGeneration` folder as llama.cpp's
    converter writes an mmproj file (`conversion/gemma.py:Gemma3VisionModel`): clip.* metadata,
    the projector's norm as 1 + w, embeddings and norms in F32, the input projection and the
    other matrices in F16; `f16=False` keeps every tensor F32 (not the converter's choice for the
    input projection: what a float32 comparison against HF needs)."""
    cfg = json.loads((vlm_dir / "config.json").read_text())
    vision = cfg["vision_config"]
    tensors = load_file(str(vlm_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(vision["image_size"])
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    w.add_vision_use_gelu(True)
    scale = (vision["image_size"] // vision["patch_size"]) // int(cfg["mm_tokens_per_image"] ** 0.5)
    if scale != 4:
        w.add_vision_projector_scale_factor(scale)
    for name, arr in tensors.items():
        key = name.removeprefix("model.")
        for part in ("vision_tower.vision_model.", "vision_tower.", "multi_modal_projector."):
            if key.startswith(part):
                key = key[len(part):]
                break
        else:
            continue
        if key.startswith("encoder.layers."):
            i, rest = key[len("encoder.layers."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            gguf_name = f"v.blk.{i}.{MMPROJ_LAYER[module]}.{leaf}"
        elif key in MMPROJ_NAMES:
            gguf_name = MMPROJ_NAMES[key]
        else:
            continue  # a pooling head: the converter skips it
        arr = np.asarray(arr, np.float32)
        if gguf_name == "mm.soft_emb_norm.weight":
            arr = arr + 1.0
        keep_f32 = "embd" in gguf_name or arr.ndim == 1 or not f16
        w.add_tensor(gguf_name, arr if keep_f32 else arr.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


GEMMA4_TO_GGUF = {  # HF suffix after model.layers.{i}. -> GGUF suffix, as `gguf.tensor_mapping` maps Gemma 4
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",  # Gemma4Model.modify_tensors
    "router.per_expert_scale": "ffn_down_exps.scale",  # likewise: a scale on each expert's output
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",  # [E, 2F, D]: gate rows, then up rows
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}
GEMMA4_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                  "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                  "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}


def write_gemma4_gguf(hf_dir: Path, out: Path, tweak: Callable[[gguf.GGUFWriter], None] | None = None,
                      rope_freqs: np.ndarray | None = None,
                      quant: Callable[[str, np.ndarray], tuple] | None = None) -> Path:
    """A `Gemma4ForCausalLM` folder as llama.cpp's converter writes it (`gemma4`,
    `conversion/gemma.py:Gemma4Model` over Gemma3Model and TextModel): norms as they are (no 1 + w),
    rows unpermuted; the full layers' head size as `key_length` and the sliding layers' as
    `key_length_swa`; kv heads per layer when the full layers have their own; feed-forward widths
    per layer with use_double_wide_mlp; `shared_kv_layers`, `embedding_length_per_layer_input`, the
    window pattern as booleans; the full layers' proportional RoPE as `rope_freqs.weight` (ones for
    the rotated frequency pairs, 1e30 for the rest) and `rope.dimension_count` = their head size;
    the router's scale and the per-expert scale renamed as `Gemma4Model.modify_tensors` does. The
    tokenizer is the checkpoint's byte-level BPE as `gpt2` (the converter writes Gemma 4's own
    `gemma4` vocabulary). `tweak(writer)` runs after the metadata is written (a key written again
    replaces it) and `rope_freqs` replaces the RoPE tensor: files the converter would not write, for
    the loader's refusals and the tests' negative controls. `quant` as `write_gguf`'s."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "gemma4")
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"]
    is_swa = [t == "sliding_attention" for t in types]
    # The converter's reading: global_head_dim / num_global_key_value_heads, else the first full
    # layer's entry in per_layer_config (what transformers saves).
    full_layer = next(dict(v) for k, v in sorted((cfg.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0]))
                      if types[int(k)] == "full_attention") if cfg.get("per_layer_config") else {}
    swa_dim = cfg["head_dim"]
    full_dim = cfg.get("global_head_dim") or full_layer.get("head_dim")
    kv_full = cfg.get("num_global_key_value_heads") or full_layer.get("num_key_value_heads")
    shared = cfg.get("num_kv_shared_layers") or 0
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    n_ff = cfg["intermediate_size"]
    w.add_feed_forward_length([n_ff if i < n - shared else 2 * n_ff for i in range(n)]
                              if cfg.get("use_double_wide_mlp") else n_ff)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if s else kv_full for s in is_swa] if kv_full is not None
                        else cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    full, local = rope["full_attention"], rope["sliding_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(is_swa)
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(int(swa_dim * local.get("partial_rotary_factor", 1.0)))
    _add_tokenizer(w, hf_dir)
    rotated = int(full_dim * full["partial_rotary_factor"] / 2)
    if tweak is not None:
        tweak(w)
    if rope_freqs is None:
        rope_freqs = np.asarray([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), np.float32)
    w.add_tensor("rope_freqs.weight", rope_freqs)

    def add(gguf_name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.float32)
        blocks = quant(gguf_name, arr) if quant is not None and arr.ndim >= 2 else None
        w.add_tensor(gguf_name, arr) if blocks is None else w.add_tensor(gguf_name, blocks[0], raw_dtype=blocks[1])

    for name, arr in tensors.items():
        if name in GEMMA4_GLOBALS:
            add(GEMMA4_GLOBALS[name], arr)
        elif name == "lm_head.weight" and not cfg.get("tie_word_embeddings", True):
            add("output.weight", arr)
    for i in range(n):
        prefix = f"model.layers.{i}."
        for name, arr in tensors.items():
            if name.startswith(prefix):
                add(f"blk.{i}.{GEMMA4_TO_GGUF[name[len(prefix):]]}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


DEEPSEEK2_TO_GGUF = {  # HF suffix -> GGUF suffix, llama.cpp's DeepseekV2Model (conversion/deepseek.py)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

NEXTN_TO_GGUF = {  # an MTP layer's own HF suffixes -> gguf-py's NEXTN_* names (after blk.{n}.)
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
}


def write_deepseek2_gguf(hf_dir: Path, out: Path, split_kv_b: bool = True, gating_func: int = 2,
                         mtp: bool = False, quant: Callable[[str, np.ndarray], tuple] | None = None) -> Path:
    """A DeepSeek-V3 checkpoint as llama.cpp's converter writes `deepseek2`: MLA as MQA
    (`head_count_kv` 1, key_length r + dr, value_length r, the real widths in
    `key_length_mla` / `value_length_mla`), the routing keys, YaRN's mscale_all_dim as
    `yarn_log_multiplier` = 0.1 * mscale_all_dim, the experts stacked, and (`split_kv_b`, newer
    converters) kv_b_proj split per head into `attn_k_b` [H, r, dn] (transposed) and `attn_v_b`
    [H, dv, r]; else kept as `attn_kv_b`. `gating_func`: llama.cpp's expert gating (2 sigmoid,
    1 softmax). The multi-token-prediction layers (`model.layers.{n}.*`, n = num_hidden_layers
    on) are skipped, as `DeepseekV2Model` does (`skip_mtp`); `mtp=True` writes them as its
    subclasses that keep them do (`DeepseekV32Model`, `Glm4MoeLiteModel`, run without
    `--no-mtp`): block_count n + num_nextn_predict_layers, `nextn_predict_layers`, the layer's
    decoder tensors under the usual names at `blk.{n}` and eh_proj / enorm / hnorm /
    shared_head.norm / shared_head.head / embed_tokens as `blk.{n}.nextn.eh_proj` / `enorm` /
    `hnorm` / `shared_head_norm` / `shared_head_head` / `embed_tokens` (gguf-py's NEXTN names).
    `quant` as `write_gguf`'s."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "deepseek2")
    n_layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    r, dn, dr, dv = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    n_mtp = (cfg.get("num_nextn_predict_layers") or 0) if mtp else 0
    w.add_block_count(n_layers + n_mtp)
    if n_mtp:
        w.add_uint32("deepseek2.nextn_predict_layers", n_mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    a = "deepseek2"
    w.add_uint32(f"{a}.leading_dense_block_count", cfg.get("first_k_dense_replace") or 0)
    w.add_uint32(f"{a}.vocab_size", cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_uint32(f"{a}.attention.q_lora_rank", cfg["q_lora_rank"])
    w.add_uint32(f"{a}.attention.kv_lora_rank", r)
    w.add_key_length(r + dr)
    w.add_value_length(r)
    w.add_uint32(f"{a}.attention.key_length_mla", dn + dr)
    w.add_uint32(f"{a}.attention.value_length_mla", dv)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_uint32(f"{a}.expert_group_count", cfg.get("n_group") or 1)
    w.add_uint32(f"{a}.expert_group_used_count", cfg.get("topk_group") or 1)
    w.add_uint32(f"{a}.expert_gating_func", gating_func)
    w.add_uint32(f"{a}.expert_shared_count", cfg.get("n_shared_experts") or 0)
    w.add_float32(f"{a}.expert_weights_scale", cfg.get("routed_scaling_factor", 1.0))
    if cfg.get("norm_topk_prob"):
        w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_rope_dimension_count(dr)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if rope.get("mscale_all_dim") is not None:
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])
    _add_tokenizer(w, hf_dir)

    def add(gguf_name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.float32)
        packed = quant(gguf_name, arr) if quant is not None and arr.ndim >= 2 else None
        w.add_tensor(gguf_name, arr) if packed is None else w.add_tensor(gguf_name, packed[0], raw_dtype=packed[1])

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"])
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", tensors["lm_head.weight"])
    for i in range(n_layers + n_mtp):
        prefix = f"model.layers.{i}."
        stacks: dict[str, dict[int, np.ndarray]] = {}
        for name, arr in tensors.items():
            if not name.startswith(prefix):
                continue
            suffix = name[len(prefix):]
            expert = _expert_suffix(suffix)
            if expert is not None:
                stacks.setdefault(EXPERTS_TO_GGUF[expert[0]], {})[expert[1]] = arr
            elif suffix == "self_attn.kv_b_proj.weight" and split_kv_b:
                kv_b = arr.reshape(heads, dn + dv, r)
                add(f"blk.{i}.attn_k_b.weight", kv_b[:, :dn].swapaxes(1, 2))
                add(f"blk.{i}.attn_v_b.weight", kv_b[:, dn:])
            else:
                add(f"blk.{i}.{DEEPSEEK2_TO_GGUF.get(suffix) or NEXTN_TO_GGUF[suffix]}", arr)
        for gguf_name, by_expert in stacks.items():
            add(f"blk.{i}.{gguf_name}", np.stack([by_expert[e] for e in range(cfg["n_routed_experts"])]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_glm4moe_gguf(hf_dir: Path, out: Path, tweak: Callable[[gguf.GGUFWriter], None] | None = None,
                       quant: Callable[[str, np.ndarray], tuple] | None = None) -> Path:
    """A `Glm4MoeForCausalLM` folder as llama.cpp's converter writes `glm4moe`
    (`conversion/glm.py:Glm4MoeModel` over TextModel): `block_count` counts the
    `num_nextn_predict_layers` multi-token-prediction layers too (present in the folder or not)
    and `nextn_predict_layers` says how many; `rope.dimension_count` is head_dim *
    partial_rotary_factor; the routing as `expert_*` keys (the gating function sigmoid,
    `expert_weights_norm` only when the config has norm_topk_prob, `expert_group_*` from n_group /
    topk_group); no key for attention_bias or use_qk_norm (the tensors say); names through
    gguf-py's own GLM4_MOE name map (post_attention_layernorm -> `post_attention_norm`,
    `e_score_correction_bias` -> `exp_probs_b.bias`, an MTP layer's eh_proj / enorm / hnorm /
    shared_head.* -> `nextn.*`), the experts stacked, rows unpermuted. `tweak(writer)` runs after
    the metadata (files the converter would not write); `quant` as `write_gguf`'s."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    n_main, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
    blocks = n_main + mtp
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, blocks)
    w = gguf.GGUFWriter(str(out), "glm4moe")
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope_dim = head_dim or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(rope_dim * rope.get("partial_rotary_factor", 0.5)))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("n_shared_experts") is not None:
        w.add_expert_shared_count(cfg["n_shared_experts"])
    if cfg.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if mtp:
        w.add_uint32("glm4moe.nextn_predict_layers", mtp)
    _add_tokenizer(w, hf_dir)
    if tweak is not None:
        tweak(w)

    def add(gguf_name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.float32)
        packed = quant(gguf_name, arr) if quant is not None and arr.ndim >= 2 else None
        w.add_tensor(gguf_name, arr) if packed is None else w.add_tensor(gguf_name, packed[0], raw_dtype=packed[1])

    def gguf_name(hf_name: str) -> str:
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, hf_name
        return mapped

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"])
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", tensors["lm_head.weight"])
    for i in range(blocks):
        prefix = f"model.layers.{i}."
        stacks: dict[str, dict[int, np.ndarray]] = {}
        for name, arr in tensors.items():
            if not name.startswith(prefix):
                continue
            expert = _expert_suffix(name[len(prefix):])
            if expert is not None:
                stacks.setdefault(EXPERTS_TO_GGUF[expert[0]], {})[expert[1]] = arr
            else:
                add(gguf_name(name), arr)
        for stacked, by_expert in stacks.items():
            add(f"blk.{i}.{stacked}", np.stack([by_expert[e] for e in range(cfg["n_routed_experts"])]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tiled_heads(arr: np.ndarray, axis: int, k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """`_LinearAttentionVReorderBase._reorder_v_heads`: value heads grouped by k head -> tiled."""
    arr = np.moveaxis(arr, axis, 0)
    out = arr.reshape(k_heads, v_per_k, head_dim, *arr.shape[1:]).swapaxes(0, 1).reshape(arr.shape)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def write_qwen35_gguf(hf_dir: Path, out: Path, tweak: Callable[[gguf.GGUFWriter], None] | None = None,
                      quant: Callable[[str, np.ndarray], tuple] | None = None, arch: str = "qwen35",
                      mtp_only: bool = False) -> Path:
    """A `Qwen3_5ForCausalLM` folder as llama.cpp's converter writes `qwen35`
    (`conversion/qwen.py:Qwen3_5TextModel` over `_LinearAttentionVReorderBase`, Qwen3NextModel,
    the MTP mixin and TextModel), as run with `--no-mtp` (transformers saves no `mtp.*` tensors,
    and without them the converter's MTP count asserts): the `ssm.*` keys (conv kernel, k head
    size as state_size, k heads as group_count, v heads as time_step_rank, v heads * v head size
    as inner_size), `attention.recurrent_layers` from layer_types, `full_attention_interval`,
    `rope.dimension_count` = head_dim * partial_rotary_factor (0.25 by default),
    `rope.dimension_sections` [11, 11, 10, 0] when the config has no mrope_section; tensors
    renamed through gguf-py's QWEN35 map (dt_bias as `ssm_dt.bias`), every norm but the DeltaNet
    gated norm stored as 1 + w, A_log as -exp(A_log), conv1d squeezed to [C, Kc], and with fewer
    k heads than v heads the value heads reordered from grouped to tiled (the v rows of
    in_proj_qkv and conv1d, in_proj_z / in_proj_b / in_proj_a rows, A_log, dt_bias, out_proj
    columns). `arch="qwen35moe"` (`Qwen3_5MoeTextModel`, a `Qwen3_5MoeForCausalLM` folder) adds
    Qwen2MoeModel's expert keys (expert_count, expert_used_count, expert_feed_forward_length,
    expert_shared_feed_forward_length; no feed_forward_length: the config has no dense width), the
    per-expert tensors stacked into `ffn_*_exps`, the shared expert as `ffn_*_shexp` and its gate
    as `ffn_gate_inp_shexp`. `arch="qwen3next"` (`Qwen3NextModel`, a `Qwen3NextForCausalLM`
    folder): the same keys with feed_forward_length, no `rope.dimension_sections` (it has no M-RoPE
    mixin), the value heads not reordered, and the fused `in_proj_qkvz` split into `attn_qkv` (q, k,
    v of every k head) and `attn_gate` (z); `in_proj_ba` kept whole as `ssm_ba`. `tweak(writer)`
    runs after the metadata; `quant` as `write_gguf`'s. A folder with `mtp.*` tensors (the Hub's
    multi-token-prediction block) is written as `_QwenMtpMixin` does: `mtp.layers.{j}.*` as layer
    n + j, `mtp.fc` / `pre_fc_norm_embedding` / `pre_fc_norm_hidden` / `norm` as that layer's
    `nextn.eh_proj` / `enorm` / `hnorm` / `shared_head_norm`, block_count and the recurrent mask
    extended, `nextn_predict_layers` written. `mtp_only` (the converter's `--mtp`: the block as a
    draft file of its own) keeps only the block's tensors and the embedding, final norm and LM
    head, with the same metadata."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    n_main = cfg["num_hidden_layers"]
    remap = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}
    for name in [k for k in tensors if k.startswith(("mtp.", "model.mtp."))]:  # _QwenMtpMixin.filter_tensors
        parts = name.removeprefix("model.").split(".", 3)
        if parts[1] == "layers":
            tensors[f"model.layers.{n_main + int(parts[2])}.{parts[3]}"] = tensors.pop(name)
        else:
            tensors[f"model.layers.{n_main}.{remap[parts[1]]}.{parts[2]}"] = tensors.pop(name)
    n_mtp = max([int(k.split(".")[2]) + 1 - n_main for k in tensors if k.startswith("model.layers.")] + [0])
    n = n_main + n_mtp
    model_arch = {"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
                  "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}[arch]
    names = gguf.get_tensor_name_map(model_arch, n)
    w = gguf.GGUFWriter(str(out), arch)
    rope = cfg.get("rope_parameters") or {}
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size") is not None:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts") is not None:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    if cfg.get("layer_types") is not None:
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg["layer_types"]] + [False] * n_mtp)
    if n_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next" or rope.get("mrope_section"):
        w.add_rope_dimension_sections(rope.get("mrope_section") or [11, 11, 10, 0])
    _add_tokenizer(w, hf_dir)
    if tweak is not None:
        tweak(w)

    def add(gguf_name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.float32)
        packed = quant(gguf_name, arr) if quant is not None and arr.ndim >= 2 else None
        w.add_tensor(gguf_name, arr) if packed is None else w.add_tensor(gguf_name, packed[0], raw_dtype=packed[1])

    def converted(name: str, arr: np.ndarray) -> tuple[str, np.ndarray]:
        arr = np.asarray(arr, np.float32)
        r, qk = hv // hk, 2 * hk * dk
        if r > 1 and "linear_attn." in name and arch != "qwen3next":  # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in name:
                arr = np.concatenate([arr[:qk], _tiled_heads(arr[qk:], 0, hk, r, dv)])
            elif ".in_proj_z." in name:
                arr = _tiled_heads(arr, 0, hk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
                arr = _tiled_heads(arr, 0, hk, r, 1)
            elif ".conv1d" in name:
                arr = arr.squeeze()
                arr = np.concatenate([arr[:qk], _tiled_heads(arr[qk:], 0, hk, r, dv)])
            elif ".out_proj." in name:
                arr = _tiled_heads(arr, 1, hk, r, dv)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            arr = -np.exp(arr)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            arr = arr.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            arr = arr + 1
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        parts = name.split(".", 3)
        if mapped is None and len(parts) == 4 and parts[3].removesuffix(".weight") in remap.values():
            mapped = f"blk.{parts[2]}.nextn.{parts[3].removesuffix('.weight').replace('.', '_')}.weight"
        assert mapped is not None, name
        return mapped, arr

    def split_qkvz(name: str, arr: np.ndarray) -> None:
        """Qwen3NextModel.modify_tensors: per k head [q, k, v, z] -> attn_qkv [q | k | v], attn_gate [z]."""
        group_v = hv // hk * dv
        q, k, v, z = np.split(arr.reshape(hk, -1, arr.shape[-1]), [dk, 2 * dk, 2 * dk + group_v], axis=1)
        layer = name.split(".")[2]
        add(f"blk.{layer}.attn_qkv.weight", np.concatenate([x.reshape(-1, arr.shape[-1]) for x in (q, k, v)]))
        add(f"blk.{layer}.attn_gate.weight", z.reshape(-1, arr.shape[-1]))

    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, arr in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        parts = name.split(".")
        if mtp_only and parts[:2] == ["model", "layers"] and int(parts[2]) < n_main:  # _QwenMtpMixin.filter_tensors
            continue
        if len(parts) > 6 and parts[3:5] == ["mlp", "experts"]:  # Qwen2MoeModel: stacked per layer
            stacks.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = arr
            continue
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            split_qkvz(name, arr)
            continue
        add(*converted(name, arr))
    for (i, proj), by_expert in sorted(stacks.items()):
        stacked = np.stack([by_expert[e] for e in range(cfg["num_experts"])])
        add(*converted(f"model.layers.{i}.mlp.experts.{proj}.weight", stacked))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
