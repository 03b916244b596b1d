"""Tensor parallelism for latent attention: a tiny DeepSeek-V3 (4 heads, 2 groups of 4
experts, a shared expert, layer 0 dense) at tp=4 on CPU devices against one device, in
one subprocess (tests/support/sharding_probe.py `families`). The latent cache is one
head, so it is replicated; the heads' up-projections split, and the compiled decode
step gathers nothing but the logits; the experts and the shared expert split over their
intermediate axis, the dense layer's MLP as any dense MLP. The expanded prefill
(`models/mla.py:expanded_attention`, every prompt chunk) with the heads split matches one
device too."""

from __future__ import annotations

import transformers

from tests.models.test_family_deepseek_v3 import SHAPE
from tests.support import family_checks as fc
from tests.system.test_sharding import ATOL, _probe


def test_tp4_matches_one_device_with_a_replicated_latent_cache(tmp_path):
    config = transformers.DeepseekV3Config(**SHAPE, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                           topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                           routed_scaling_factor=2.5, max_position_embeddings=256,
                                           tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path / "dsv3", config)
    got = _probe("collectives", str(path))["DeepseekV3ForCausalLM"]
    parity, place = got["parity"], got["placement"]
    assert parity["prefill_err"] < ATOL and parity["decode_err"] < ATOL, parity
    assert parity["same_greedy"]
    expanded = got["expanded_parity"]  # every prompt chunk attending expanded, heads split
    assert expanded["prefill_err"] < ATOL and expanded["decode_err"] < ATOL and expanded["same_greedy"], expanded
    # [1 head, blocks, block size, kv_lora_rank 16 + qk_rope_head_dim 8], whole on each of the 4 devices
    assert place["kv_k0"]["num_shards"] == 4 and place["kv_k0"]["shard_shapes"] == [[1, 64, 8, 24]]
    # heads split: each device its heads' up-projections (4 heads x (16 + 12) columns of kv_b_proj)
    assert place["layers.1.kv_b_proj"]["shard_shapes"] == [[16, 4 * 28 // 4]]
    assert place["layers.1.q_b_proj"]["shard_shapes"] == [[24, 4 * 24 // 4]]
    assert place["layers.1.kv_a_proj"]["shard_shapes"] == [[64, 24]], "the latent's down-projection is replicated"
    assert place["layers.1.experts_gate"]["shard_shapes"] == [[8, 64, 32 // 4]]
    assert place["layers.1.down_proj"]["shard_shapes"] == [[32 // 4, 64]], "the shared expert is split"
    assert place["layers.0.down_proj"]["shard_shapes"] == [[96 // 4, 64]], "the dense layer's MLP is split"
    # Heads stay local: the decode step gathers only the vocab-split logits (one row x 384), and
    # all-reduces after o_proj and the MLPs; no attention weight or activation is gathered.
    assert got["all_gathered"] and set(got["all_gathered"]) == {"f32[1,384]"}, got["all_gathered"]
    assert set(got["collectives"]) == {"all-gather", "all-reduce"}, got["collectives"]


def test_memory_bounds_count_a_replicated_latent_cache_whole_on_each_device():
    """The footprint divides the KV bytes by the devices the cache heads split over: not
    for a latent cache (one head), still for plain heads (the control)."""
    from types import SimpleNamespace

    from ferrox_jax.memory_bounds import kv_shards
    from models.deepseek_v3 import config_from_hf

    settings = SimpleNamespace(mesh_shape=(1, 4), replicate_attention=False)
    mla = config_from_hf(transformers.DeepseekV3Config(**SHAPE, n_routed_experts=8, num_experts_per_tok=2,
                                                       n_group=2, topk_group=1).to_dict())
    assert kv_shards(settings, mla) == 1
    assert kv_shards(settings, plain_config()) == 4


def plain_config():
    from models.config import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=4, head_dim=8, max_position_embeddings=512)
