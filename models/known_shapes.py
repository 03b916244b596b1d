"""Shapes of a few public checkpoints, as config-only HF folders: a model of real size
without its weights.

`SHAPES` holds the `config.json` of each (shapes only: the numbers in their published
configs), plus `tiny`, every code path of the 8B at a size a CPU runs in seconds.
`write_config_folder(name, folder)` writes one as a config-only HF folder that
`--load-format dummy` serves with random weights (no tokenizer.json: the byte-level
fallback tokenizer is used). Tests of the dummy loader, the device check
(tools/device/device_check.py), the sizing CLI (tools/device/model_shapes.py) and the
random-weight GGUF writer (tools/bench/shape_gguf.py) share them; the module
imports nothing beyond the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = {**_LLAMA3_ROPE, "factor": 32.0}

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    },
    # meta-llama/Llama-3.2-1B and -3B: tied embeddings, llama3 RoPE with factor 32.
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA32_ROPE, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA32_ROPE, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    },
    # Qwen/Qwen3-4B (tied) and Qwen3-8B (untied): per-head q/k norms, no RoPE scaling.
    "qwen3-4b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2560,
        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    },
    # The text decoder of google/gemma-3-27b-it (its config's text_config), as a text-only checkpoint.
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 5376,
        "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "sliding_window_pattern": 6, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106],
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # Latent attention (kv_lora_rank 512 + one 64-dim RoPE key cached per token and layer) and
    # 256 experts in 8 groups; DeepSeek-V3.1 has the same shape.
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                              "mscale": 1.0, "mscale_all_dim": 1.0,
                                              "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
        "num_nextn_predict_layers": 1,
    },
    # DeepSeek-V3's architecture with 64 heads, 384 experts in one group and one dense layer.
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
        "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                                "mscale": 1.0, "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585, "hidden_act": "silu",
    },
    "glm-4.5": {
        "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 5120,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "attention_bias": True, "use_qk_norm": True, "n_shared_experts": 1, "n_routed_experts": 160,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000, "tie_word_embeddings": False, "eos_token_id": [151329, 151336, 151338],
        "hidden_act": "silu", "num_nextn_predict_layers": 1,
    },
    # The text decoders of meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E (their
    # configs' text_config), as text-only checkpoints: chunked attention (8192) on three of
    # every four layers, NoPE full attention on the fourth; Scout 16 experts on every layer
    # with the q/k norm and llama3 RoPE 16x, Maverick 128 experts on every second layer
    # (the others a dense MLP of intermediate_size_mlp), no q/k norm, no RoPE scaling.
    "llama-4-scout": {
        "architectures": ["Llama4ForCausalLM"], "vocab_size": 202048, "hidden_size": 5120,
        "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
        "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        "hidden_act": "silu",
    },
    "llama-4-maverick": {
        "architectures": ["Llama4ForCausalLM"], "vocab_size": 202048, "hidden_size": 5120,
        "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 128,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "use_qk_norm": False, "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        "hidden_act": "silu",
    },
    # The device check's --small shape: every code path of the 8B, in seconds on a CPU.
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 300, "hidden_act": "silu",
    },
    # tools/device/export_steps.py's test shape for a family with two layer kinds (window, soft-cap).
    "tiny-gemma2": {
        "architectures": ["Gemma2ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 64, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
    },
}


def write_config_folder(name: str, folder: str | Path) -> Path:
    """Write SHAPES[name] as `folder/config.json` (a config-only HF folder); returns folder."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[name], indent=2) + "\n")
    return folder
