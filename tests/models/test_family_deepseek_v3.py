"""DeepSeek-V3 against HF transformers: multi-head latent attention over the latent cache
(q through q_a_proj / q_b_proj, interleaved RoPE, YaRN with mscale on the softmax scale),
grouped sigmoid routing with a non-zero e_score_correction_bias (4 of 8 experts
reachable per token: 1 of 2 groups), a shared expert, and layer 0 dense.

Besides the shared family checks: the routing against HF's router module, the absorbed
attention against the expanded one with a wrong absorbed matrix as negative control, and
the cache's bytes per token as the server reports them, against full heads."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from tests.support import family_checks as fc

NUM_EXPERTS = 8
SHAPE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=12)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def _config(**overrides):
    fields = dict(SHAPE, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=2, n_group=2, topk_group=1,
                  n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  max_position_embeddings=256, tie_word_embeddings=False, rope_parameters=YARN)
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    import torch

    path = fc.make_checkpoint(tmp_path_factory.mktemp("dsv3") / "tiny-deepseek-v3", _config())
    hf = fc.hf_model(path)
    torch.manual_seed(3)  # a buffer the random init leaves at zero: make the choice bias matter
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(NUM_EXPERTS))
    hf.save_pretrained(path)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_config_reads_mla_yarn_and_routing(deepseek):
    cfg = deepseek[2].config
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (24, 16, 16, 8, 12)
    assert cfg.head_dim == 8 and cfg.rope_interleave and cfg.dense_layers == (0,)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.n_shared_experts) == (2, 1, 2.5, 1)
    assert cfg.yarn.factor == 4.0 and cfg.yarn.attention_factor == pytest.approx(
        deepseek[1].model.rotary_emb.attention_scaling, rel=1e-12)
    assert cfg.mla_spec().scale == pytest.approx(deepseek[1].model.layers[0].self_attn.scaling, rel=1e-12)
    assert cfg.kv_cache_dims() == (1, 16 + 8, 0)


def test_matches_transformers(deepseek):
    fc.assert_report(deepseek[2], "deepseek_v3")


def test_both_groups_route(deepseek):
    _, hf, report = deepseek
    routed = fc.experts_routed(hf, report.tokens)
    assert len(routed) == 2 and all(r & set(range(4)) and r & set(range(4, 8)) for r in routed)


def test_grouped_routing_matches_hf_router(deepseek):
    """Our routing against HF's router module on 64 random rows: the same experts and
    weights. Negative control: weighting by the corrected scores (the bias used beyond
    the choice) or ignoring the groups would not match."""
    import jax.numpy as jnp
    import torch

    from models.moe_grouped import grouped_route

    router = deepseek[1].model.layers[1].mlp.gate
    x = np.random.RandomState(0).randn(64, 64).astype(np.float32)
    with torch.no_grad():
        _, hf_w, hf_e = router(torch.tensor(x))
    hf_w, hf_e = hf_w.numpy(), hf_e.numpy()
    order = np.argsort(hf_e, axis=1)
    hf_w, hf_e = np.take_along_axis(hf_w, order, 1), np.take_along_axis(hf_e, order, 1)
    w_t, b = jnp.asarray(router.weight.detach().numpy().T), jnp.asarray(router.e_score_correction_bias.numpy())

    def ours(bias, n_group=2):
        w, e = grouped_route(jnp.asarray(x), w_t, bias, top_k=2, n_group=n_group, topk_group=1, normalize=True,
                             scale=2.5)
        order = np.argsort(np.asarray(e), axis=1)
        return np.take_along_axis(np.asarray(w), order, 1), np.take_along_axis(np.asarray(e), order, 1)

    w, e = ours(b)
    np.testing.assert_array_equal(e, hf_e)
    np.testing.assert_allclose(w, hf_w, atol=1e-6)
    _, e_no_bias = ours(jnp.zeros_like(b))
    assert (e_no_bias != hf_e).any(), "the correction bias must change the choice on these rows"
    _, e_no_groups = ours(b, n_group=1)
    assert (e_no_groups != hf_e).any(), "the group limit must change the choice on these rows"
    scores = 1 / (1 + np.exp(-(x @ np.asarray(w_t))))
    biased = np.take_along_axis(scores + np.asarray(b), hf_e, 1)
    assert np.abs(2.5 * biased / biased.sum(1, keepdims=True) - hf_w).max() > 1e-3


def _expanded_attention(q_nope, q_rope, latent, k_rope, kv_b, spec):
    """HF's expanded MLA (one row, causal) in numpy: k = [W_UK c | k_rope], v = W_UV c."""
    t, h = q_nope.shape[:2]
    per_head = kv_b.reshape(spec.kv_lora_rank, h, spec.nope_dim + spec.v_dim)
    k_nope = np.einsum("tr,rhd->thd", latent, per_head[..., :spec.nope_dim])
    v = np.einsum("tr,rhd->thd", latent, per_head[..., spec.nope_dim:])
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (t, h, spec.rope_dim))], -1)
    q = np.concatenate([q_nope, q_rope], -1)
    s = np.einsum("thd,shd->hts", q, k) * spec.scale
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(t, h * spec.v_dim)


def test_absorbed_attention_matches_expanded():
    """The latent-cache attention (W_UK on the query, W_UV after the sum) equals HF's
    expanded attention; with a wrong absorbed matrix (heads shifted, or the k/v split
    swapped) it does not."""
    import jax.numpy as jnp

    from ferrox_jax.kv_cache import create_kv_cache
    from models.layers import Segment
    from models.mla import MlaSpec, absorbed_weights, latent_attention, write_latent

    spec = MlaSpec(num_heads=4, q_lora_rank=0, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=8, scale=0.2,
                   interleave=True, norm_eps=1e-6)
    rng = np.random.RandomState(0)
    t, bs = 12, 4
    q_nope, q_rope = rng.randn(t, 4, 8).astype(np.float32), rng.randn(t, 4, 8).astype(np.float32)
    latent, k_rope = rng.randn(t, 16).astype(np.float32), rng.randn(t, 8).astype(np.float32)
    kv_b = (rng.randn(16, 4 * 16) * 0.3).astype(np.float32)
    cache = create_kv_cache(1, 1, 8, bs, spec.cache_width, jnp.float32, v_head_dim=0).k[0]
    blocks = np.array([5, 2, 7])
    pos = np.arange(t)
    cache = write_latent(cache, jnp.asarray(np.concatenate([latent, k_rope], -1)), jnp.asarray(blocks[pos // bs]),
                         jnp.asarray(pos % bs))
    table = np.zeros((1, 8), np.int32)
    table[0, :3] = blocks
    seg = Segment(0, 1, t, jnp.asarray(pos[None]), jnp.ones((1, t), bool), jnp.asarray(table))
    want = _expanded_attention(q_nope, q_rope, latent, k_rope, kv_b, spec)

    def run(w_uk, w_uv):
        return np.asarray(latent_attention(jnp.asarray(q_nope), jnp.asarray(q_rope), cache, (seg,), spec, w_uk, w_uv))

    w_uk, w_uv = absorbed_weights(jnp.asarray(kv_b), spec)
    assert np.abs(run(w_uk, w_uv) - want).max() < 1e-5
    assert np.abs(run(jnp.roll(w_uk, 1, axis=1), w_uv) - want).max() > 1e-2  # another head's W_UK
    assert np.abs(run(w_uv, w_uk) - want).max() > 1e-2  # the k/v halves of kv_b_proj swapped


def test_served_end_to_end_and_kv_bytes(deepseek):
    """A real server; its KV accounting (/admin/stats, /v1/cache/status) is the latent
    cache's real size: (r + dr) values per token and layer, against 2*H*... for full heads."""
    import httpx

    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    path, hf, report = deepseek
    fc.assert_served(fc.serve(path), hf, "DeepseekV3ForCausalLM")
    engine = tiny_engine(path, **fc.SERVE_LIMITS)  # the engine serve() started
    with ServerThread(create_app(engine)) as base:
        status = httpx.get(base + "/v1/cache/status").json()
        info = httpx.get(base + "/admin/stats").json()["model_info"]
    cfg = report.config
    latent_per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # float32
    full_per_token = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                       + cfg.v_head_dim) * 4
    assert status["bytes_per_block"] == latent_per_token * status["block_size"]
    cache = engine.runner.runner.kv_cache  # the device runner inside the tests' fault wrapper
    assert cache.nbytes == status["bytes_total"] == info["kv_bytes"]
    assert cache.k[0].shape[0] == 1 and cache.v[0].shape[-1] == 0
    assert "latent" in engine.attention_note, "the decode kernels read K/V heads: the engine must not pick one"
    print(f"KV bytes per token: latent {latent_per_token}, full heads {full_per_token} "
          f"({full_per_token / latent_per_token:.1f}x)")
    assert full_per_token / latent_per_token == pytest.approx(4 * 36 / 24)


def test_plain_q_proj_and_rotate_half_rope_match_transformers(tmp_path):
    """The other branches: q_lora_rank None (q_proj, as DeepSeek-V2-Lite), rope_interleave
    false and no YaRN; a 40-token prefill against HF's logits."""
    from tests.support.engine_helpers import make_runner

    config = _config(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})
    path = fc.make_checkpoint(tmp_path / "dsv3-plain", config)
    runner, ckpt = make_runner(path, num_blocks=32, block_size=fc.BLOCK_SIZE, max_rows=2, max_chunk_tokens=64,
                               max_context=fc.MAX_CONTEXT)
    assert ckpt.config.q_lora_rank == 0 and not ckpt.config.rope_interleave and ckpt.config.yarn is None
    prompt = np.random.RandomState(1).randint(0, ckpt.config.vocab_size, 40).tolist()
    ours = runner.run_logits([fc._row(prompt, 0, list(range(1, 11)))])[0]
    assert np.abs(ours - fc.hf_logits(fc.hf_model(path), prompt)).max() < fc.ATOL
