"""Llama 4 text (Llama4ForCausalLM) against HF transformers: 4 layers (three chunked RoPE
layers with the L2 q/k norm, the fourth NoPE with full attention and temperature tuning),
chunks of 16 positions so the 48-token prefill and the 32 decode steps cross four chunk
boundaries, 4 experts with sigmoid top-1 routing and a shared expert on every second layer,
the dense MLP elsewhere. floor_scale 8 and attn_scale 0.5 make the temperature move within
80 positions (1 at position 0, 1.35 at 7, 2.1 at 79)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers

from tests.support import family_checks as fc
from tests.support.engine_helpers import float32_matmuls  # noqa: F401  (autouse)
from tests.support.xla_flags import with_devices

CHUNK = 16


def llama4_config(**overrides):
    fields = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                  attention_chunk_size=CHUNK, floor_scale=8, attn_scale=0.5, use_qk_norm=True,
                  tie_word_embeddings=False)
    return transformers.Llama4TextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    path = fc.make_checkpoint(tmp_path_factory.mktemp("llama4") / "tiny-llama4", llama4_config())
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def _prompt_err(model, hf, prompt, decode: int = 0) -> float:
    """max |ours - HF| over the prompt's logits through a fresh runner: one prefill of all but
    the last `decode` tokens, then those as one-token decode rows."""
    from ferrox_jax.runner import ModelRunner
    from tests.support.engine_helpers import shuffled_blocks

    runner = ModelRunner(model, num_blocks=16, block_size=fc.BLOCK_SIZE, max_rows=1, max_chunk_tokens=32,
                         max_context=64)
    blocks, n = shuffled_blocks(len(prompt) // fc.BLOCK_SIZE + 1, 16, seed=5), len(prompt) - decode
    ours = [runner.run_logits([fc._row(prompt[:n], 0, blocks)])[0]]
    ours += [runner.run_logits([fc._row(prompt[i:i + 1], i, blocks)])[0] for i in range(n, len(prompt))]
    return float(np.abs(np.concatenate(ours) - fc.hf_logits(hf, prompt)).max())


def test_config_reads_every_layer_kind(llama4):
    cfg = llama4[2].config
    assert cfg.rope_layers == (True, True, True, False)
    assert [cfg.chunk(i) for i in range(4)] == [CHUNK, CHUNK, CHUNK, None]
    assert cfg.dense_layers == (0, 2) and [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (cfg.intermediate_size, cfg.moe_intermediate_size) == (96, 32)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 1)
    assert cfg.qk_norm and cfg.temperature_tuning and (cfg.floor_scale, cfg.attn_scale) == (8.0, 0.5)


def test_matches_transformers(llama4):
    fc.assert_report(llama4[2], "llama4")


def test_every_expert_gets_traffic(llama4):
    """The parity above covers all four experts of both MoE layers."""
    import torch

    _, hf, report = llama4
    seen = [set(), set()]
    routers = [hf.model.layers[i].feed_forward.router for i in (1, 3)]
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: seen[i].update(
        torch.topk(out[1], 1, dim=-1).indices.flatten().tolist())) for i, r in enumerate(routers)]
    try:
        fc.hf_logits(hf, report.tokens)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [{0, 1, 2, 3}] * 2, seen


def test_prefix_cache_hit_equals_cold(llama4):
    """A second prompt sharing the first one's 40 tokens (10 full blocks, ending mid-chunk:
    positions 32..39 of chunk 32..47) reuses those blocks and prefills only its tail from
    position 40, as the engine does on a prefix-cache hit: its logits equal a cold prefill."""
    from tests.support.engine_helpers import make_runner, shuffled_blocks

    path, _, report = llama4
    runner, _ = make_runner(path, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_context=fc.MAX_CONTEXT)
    ids = shuffled_blocks(fc.NUM_BLOCKS - 1, fc.NUM_BLOCKS, seed=7)
    first = report.prompt
    second = first[:40] + np.random.RandomState(9).randint(0, report.config.vocab_size, 24).tolist()
    runner.run_logits([fc._row(first, 0, ids[:12])])
    hit = runner.run_logits([fc._row(second[40:], 40, ids[:10] + ids[12:18])])[0]
    cold = runner.run_logits([fc._row(second, 0, ids[20:36])])[0][40:]
    err = float(np.abs(hit - cold).max())
    print(f"llama4 prefix hit vs cold: {err:.2e}")
    assert err < 1e-5


def test_gguf_form_equals_safetensors(llama4, tmp_path):
    """The checkpoint written as llama.cpp's converter writes `llama4` (q/k unpermuted, the
    fused gate_up cut in halves, the shared expert as *_shexp): its prompt logits equal HF's
    and its config the safetensors one's."""
    path, hf, report = llama4
    got = fc.check_gguf(path, tmp_path / "tiny-llama4.gguf", "llama4", hf, report.prompt)
    assert got["err"] < fc.ATOL and got["same_tokens"]
    ours, ref = got["config"], got["reference_config"]
    keep = ("bos_token_id", "eos_token_ids", "rms_norm_eps")  # GGUF keeps eps as a float32
    assert dataclasses.replace(ours, **{k: getattr(ref, k) for k in keep}) == ref


def test_negative_controls_miss_transformers(llama4):
    """The checks would catch a wrong implementation: the chunk boundary one position late,
    RoPE on the NoPE layer, no temperature tuning, the router score on the expert's output
    instead of its input, each moves the logits far past the tolerance."""
    import jax
    import jax.numpy as jnp

    from models.llama4 import Llama4DecoderLayer
    from models.loader import load_checkpoint
    from models.moe import moe_mlp

    path, hf, report = llama4
    prompt = report.prompt[:24]  # crosses the chunk boundary at 16; a short compile

    def err_with(change) -> float:
        model = load_checkpoint(str(path)).model
        change(model)
        return _prompt_err(model, hf, prompt)

    def chunk_late(model):
        for layer in list(model.layers)[:3]:
            layer.chunk = CHUNK + 1

    def rope_on_nope(model):
        model.layers[3].use_rope = True

    def no_temperature(model):
        model.layers[3].temperature = None

    errs = {"chunk + 1": err_with(chunk_late), "rope on NoPE": err_with(rope_on_nope),
            "no temperature": err_with(no_temperature)}

    def score_on_output(self, h):
        logits = h @ self.router.get_value()
        top, experts = jax.lax.top_k(logits, 1)
        return moe_mlp(h, None, self.experts_gate.get_value(), self.experts_up.get_value(),
                       self.experts_down.get_value(), top_k=1, normalize=False, act=jax.nn.silu,
                       routing=(jax.nn.sigmoid(top), experts.astype(jnp.int32)))

    # A method is not part of the graph definition the step functions are compiled for: the
    # compiled steps are dropped so the patched one is traced, and dropped again after.
    original = Llama4DecoderLayer._experts
    Llama4DecoderLayer._experts = score_on_output
    jax.clear_caches()
    try:
        errs["score on output"] = err_with(lambda model: None)
    finally:
        Llama4DecoderLayer._experts = original
        jax.clear_caches()
    print("llama4 negative controls, max |Δlogit| vs HF:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(err > 100 * fc.ATOL for err in errs.values()), errs


@pytest.mark.parametrize("overrides, named", [
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["chunked_attention", "sliding_attention", "chunked_attention", "full_attention"]},
     "sliding_attention"),
    ({"layer_types": ["full_attention"] * 4}, "no_rope_layers"),
])
def test_refuses_what_it_does_not_run(overrides, named):
    from models.config import UnsupportedModelError
    from models.registry import config_from_hf

    cfg = {**llama4_config().to_dict(), "architectures": ["Llama4ForCausalLM"], **overrides}
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf(cfg)


def test_tensor_parallel_2_matches_one_device(llama4):
    """tp=2 on two simulated CPU devices (a subprocess, as tests/system/test_sharding.py): the
    same logits as one device over a 19-token prompt (crossing a chunk) and 4 decode steps;
    heads and the dense MLP split."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = llama4[0]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": with_devices(2)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / ".jax_cache"))
    proc = subprocess.run([sys.executable, str(root / "tests" / "support" / "sharding_probe.py"), "family_tp", "2",
                           str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    parity, place = got["parity"], got["placement"]
    print("llama4 tp=2 vs one device:", parity)
    assert parity["prefill_err"] < fc.ATOL and parity["decode_err"] < fc.ATOL and parity["same_greedy"], parity
    shards = {name: place[name]["shard_shapes"] for name in place}
    # layer 0 (dense): 4 heads x 16 and 2 kv heads over 2 devices; F 96 -> 48 per device
    assert shards["q_proj"] == [[64, 32]] and shards["k_proj"] == [[64, 16]] and shards["gate_proj"] == [[64, 48]]


@pytest.mark.parametrize("chunk", [CHUNK, 12])
def test_paged_chunked_attention_equals_dense_mask(chunk):
    """`paged_attention(chunk=...)` over shuffled blocks against a dense softmax under the
    mask `s <= p and s // chunk == p // chunk`: a 70-token prefill (rows starting at 0 and
    mid-chunk) and decode rows at positions whose walk starts past the first attention chunk
    (block size 4, 8 blocks a chunk: 32 keys); with the boundary one late it differs."""
    import jax.numpy as jnp

    from models.attention import paged_attention

    rng = np.random.RandomState(chunk)
    heads, kv_heads, hd, bs, num_blocks, width = 4, 2, 8, 4, 64, 24
    k_cache = rng.randn(kv_heads, num_blocks, bs, hd).astype(np.float32)
    v_cache = rng.randn(kv_heads, num_blocks, bs, hd).astype(np.float32)
    tables = np.stack([rng.permutation(np.arange(1, num_blocks))[:width] for _ in range(2)]).astype(np.int32)

    def dense(q, positions, table, c):
        keys = k_cache[:, table].reshape(kv_heads, -1, hd).repeat(heads // kv_heads, 0)
        values = v_cache[:, table].reshape(kv_heads, -1, hd).repeat(heads // kv_heads, 0)
        s = np.arange(keys.shape[1])
        out = []
        for qt, p in zip(q, positions):
            mask = (s <= p) & (s // c == p // c)
            logits = np.einsum("hd,hsd->hs", qt, keys) / np.sqrt(hd)
            w = np.exp(np.where(mask, logits, -np.inf) - logits.max(-1, keepdims=True))
            out.append(np.einsum("hs,hsd->hd", w / w.sum(-1, keepdims=True), values))
        return np.stack(out)

    for positions in (np.stack([np.arange(0, 70), np.arange(20, 90)]), np.array([[69], [93]])):
        q = rng.randn(2, positions.shape[1], heads, hd).astype(np.float32)
        got = np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache),
                                         jnp.asarray(tables), jnp.asarray(positions, jnp.int32), 1 / np.sqrt(hd),
                                         valid=jnp.ones(positions.shape, bool), chunk=chunk))
        for row in range(2):
            want = dense(q[row], positions[row], tables[row], chunk)
            assert np.abs(got[row] - want).max() < 1e-5
            assert np.abs(got[row] - dense(q[row], positions[row], tables[row], chunk + 1)).max() > 1e-2


def test_published_shapes_parse():
    """models/known_shapes.py's Scout and Maverick text decoders: NoPE every fourth layer,
    chunks of 8192, Scout's 16 experts everywhere with the q/k norm, Maverick's 128 on odd
    layers without it; both cache 8 KV heads of 128 per layer (the chunked layers' cache stays
    full-length: 196,608 bytes a token in bfloat16)."""
    from models.known_shapes import SHAPES
    from models.registry import config_from_hf

    scout, maverick = config_from_hf(SHAPES["llama-4-scout"]), config_from_hf(SHAPES["llama-4-maverick"])
    for cfg in (scout, maverick):
        assert cfg.rope_layers == (True, True, True, False) * 12 and cfg.attention_chunk == 8192
        assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (16384, 8192, 1)
        assert cfg.kv_bytes_per_token(2) == 48 * 8 * 256 * 2
    assert scout.num_experts == 16 and scout.dense_layers == () and scout.qk_norm
    assert scout.rope_scaling.rope_type == "llama3" and scout.rope_scaling.factor == 16
    assert maverick.num_experts == 128 and maverick.dense_layers == tuple(range(0, 48, 2)) and not maverick.qk_norm


def test_multimodal_checkpoint_serves_its_text_model(llama4, tmp_path):
    """A Llama4ForConditionalGeneration folder (as the Hub's Scout and Maverick, saved by
    transformers 5.25: `language_model.*` and `vision_model.*` tensors) loads as its text
    model, the vision model's tensors left unread: with the text weights of the checkpoint
    above, the prompt logits equal the wrapper's own."""
    import shutil

    import torch

    from models.loader import load_checkpoint

    path, text_hf, report = llama4
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, vision_output_dim=32, image_size=28,
                                             patch_size=14, projector_input_dim=32, projector_output_dim=32)
    text = llama4_config(vocab_size=report.config.vocab_size)
    torch.manual_seed(1)
    hf = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    hf.language_model.load_state_dict(text_hf.state_dict())  # the parity-checked text weights
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.architecture == "Llama4ForConditionalGeneration" and ckpt.config.rope_layers[3] is False
    err = _prompt_err(ckpt.model, hf, report.prompt[:24])
    print(f"llama4 ForConditionalGeneration text: max |Δlogit| vs HF {err:.2e}")
    assert err < fc.ATOL


def test_ragged_kernel_serves_the_nope_layer(llama4):
    """The ragged GPU kernel (Pallas interpret mode on the CPU), as TPUs and CUDA GPUs run: the
    NoPE layer through it, the chunked layers in pure JAX; a prefill past a chunk boundary and
    two decode rows equal HF's."""
    from models.loaders.common import build_model
    from models.loaders.safetensors import read_config, read_tensors
    from models.ragged_gpu import GpuRaggedAttention

    path, hf, report = llama4
    cfg = read_config(path)
    model = build_model(cfg, read_tensors(path, cfg), decode_attention=GpuRaggedAttention(interpret=True))
    err = _prompt_err(model, hf, report.prompt[:20], decode=2)
    print(f"llama4 ragged kernel: max |Δlogit| vs HF {err:.2e}")
    assert err < fc.ATOL


def test_top2_routing_matches_transformers(tmp_path):
    """Two experts a token (HF's sigmoid of each chosen logit scaling that expert's input; the
    released models choose one): one top-1 pass of the tiles per choice, summed."""
    from models.loader import load_checkpoint

    path = fc.make_checkpoint(tmp_path / "tiny-llama4-top2", llama4_config(num_experts_per_tok=2), seed=3)
    hf = fc.hf_model(path)
    ckpt = load_checkpoint(str(path))
    assert ckpt.config.num_experts_per_tok == 2
    prompt = np.random.RandomState(4).randint(0, ckpt.config.vocab_size, 24).tolist()
    err = _prompt_err(ckpt.model, hf, prompt)
    print(f"llama4 top-2: max |Δlogit| vs HF {err:.2e}")
    assert err < fc.ATOL


@pytest.mark.parametrize("keys, want", [
    # as llama.cpp's converter writes Scout / Maverick: llama.cpp's own constants
    ({"llama4.expert_count": 16}, dict(attention_chunk=8192, floor_scale=8192.0, attn_scale=0.1, qk_norm=True)),
    ({"llama4.expert_count": 128, "llama4.interleave_moe_layer_step": 2},
     dict(attention_chunk=8192, qk_norm=False, dense_layers=(0, 2, 4, 6))),
    # sliding_window 0: the converter's mark for every layer full (and so RoPE on every layer)
    ({"llama4.expert_count": 16, "llama4.attention.sliding_window": 0},
     dict(attention_chunk=None, rope_layers=(True,) * 8)),
])
def test_gguf_metadata_reads_as_llama_cpp_does(keys, want):
    from models.llama4 import config_from_gguf

    class Meta:
        arch = "llama4"
        values = {"llama4.expert_used_count": 1, "llama4.expert_feed_forward_length": 32, **keys}

        def get(self, key, default=None):
            return self.values.get(key, default)

        def require(self, key):
            return self.values[key]

    fields = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_layers=8, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=512, architecture="Llama4ForCausalLM")
    cfg = config_from_gguf(Meta(), fields)
    assert {k: getattr(cfg, k) for k in want} == want
    if cfg.attention_chunk:
        assert cfg.rope_layers == (True, True, True, False) * 2
