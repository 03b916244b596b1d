"""`--speculative mtp` on Qwen3.5: the checkpoint's own `mtp.*` block (models/qwen3_5_mtp.py)
drafting for the tiny random Qwen3.5 (`family_checks.make_tiny_qwen3_5`: Gated DeltaNet and
gated full attention), through the real scheduler, runner, state pool and MTP draft
(tests/support/spec_driver.py runs the owner loop's tick). The `mtp.*` tensors are written
into the checkpoint's safetensors under the released checkpoints' names.

The layer against a reference written here in torch from vLLM's definition
(`Qwen3_5MultiTokenPredictor`: the token's embedding and the hidden state each RMS-normed
(1 + w), concatenated embedding first, `fc`, one full-attention decoder layer, `norm`, the
shared LM head); its decoder layer is transformers' own `Qwen3_5DecoderLayer` (or, for
Qwen3-Next, the HF model's own full-attention layer, whose weights the block gets), so
nothing of ours is in the reference. Negative control: the concatenation hidden first.

How its drafts are made right (c): the block ignores the hidden state (fc's hidden half is
zero) and `fc`'s embedding half is fitted by least squares so that the normed embedding of
each token x of the plain greedy replies maps to the LM head's column of the token that
follows x there (succ(x); the LM head's top token for its own column is that token: the
fixture checks it). The decoder layer runs with random weights whose o_proj / down_proj are
scaled by 0.02 (its attention over its own K/V cache and its MLP run and matter a little),
and `norm` is 1 (w = 0), a positive scaling. So the block drafts succ(x_p) for a row whose
last token is x_p, and chains to succ(succ(x_p)) for k > 1. Its negative control: the same
block with fc's halves swapped (what a hidden-first concatenation reads) drafts next to
nothing right, and the output is the same.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from ferrox_jax.config import EngineConfig, SpeculativeConfig
from ferrox_jax.request import Job, RowSampling
from tests.support import family_checks as fc
from tests.support.mtp_serving import serve_one_greedy_completion
from tests.support.spec_driver import drive

MAX_ROWS = 2  # rows at once: three prompts queue behind each other
K = 3
SAMPLING = RowSampling(temperature=0.0, logprobs=1)
LOGPROB_ATOL = 1e-5
LAYER_ATOL = 1e-5
GEOMETRY = dict(num_blocks=64, block_size=8, max_chunk_tokens=8, max_context=128)


def _spec(k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, max_rows=MAX_ROWS)


STEP_ROWS = _spec().step_rows(MAX_ROWS)  # 2 speculating rows of 1 + K tokens
SLOTS = STEP_ROWS + 1  # the runner's state pool: a slot per row, and the null slot


def _rms(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def layer_tensors(tensors, layer: int, rng, scale_out: float, prefix: str = "mtp.layers.0.") -> dict[str, np.ndarray]:
    """`mtp.layers.0.*` (or another `prefix`): the shapes of the main model's layer `layer`, fresh
    random values (norms zero-centred, as the checkpoints store them), o_proj / down_proj times
    `scale_out` (tests/models/test_gguf_mtp.py builds its blocks with it too)."""
    out = {}
    for name, arr in tensors.items():
        if name.startswith(f"model.layers.{layer}."):
            suffix = name.split(".", 3)[3]
            value = rng.randn(*arr.shape) * (float(arr.std()) or 0.02) if arr.ndim > 1 else 0.1 * rng.randn(*arr.shape)
            if suffix.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * scale_out
            out[prefix + suffix] = np.asarray(value, np.float32)
    return out


def _write(path, extra: dict) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, runner, checkpoint, jobs, plain run, succ): the checkpoint's `mtp.*` block is
    the predicting one (module docstring); the runner keeps 1 + K state entries a slot and
    every token's hidden state (it compiles its shapes as they come: the served test checks
    the engine's runner and the MTP draft both stay at 0 compiles after warm-up)."""
    from safetensors.numpy import load_file

    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint

    root = tmp_path_factory.mktemp("mtp_qwen3_5")
    path = fc.make_tiny_qwen3_5(root / "tiny-qwen3_5-mtp")
    shutil.copytree(path, root / "no-mtp")  # the refusal's checkpoint: no mtp.* tensors
    ckpt = load_checkpoint(str(path))
    ckpt.model.keeps_step_hidden = True
    runner = ModelRunner(ckpt.model, max_rows=STEP_ROWS, state_entries=1 + K, **GEOMETRY)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 380, n).tolist() for n in (9, 14, 6)]
    jobs = [Job(request_id=f"r{i}", prompt_token_ids=tuple(p), max_tokens=14, sampling=SAMPLING)
            for i, p in enumerate(prompts)]
    plain = drive(runner, ckpt.tokenizer, jobs, None, max_rows=MAX_ROWS, state_slots=SLOTS)

    succ: dict[int, int] = {}
    for rid, rows in plain.tokens.items():
        for x, y in zip(rows[0], rows[0][1:]):
            succ.setdefault(x, y)
    tensors = load_file(str(path / "model.safetensors"))
    d = ckpt.config.hidden_size
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]  # [V, D] both
    xs = sorted(succ)
    want = np.stack([head[succ[x]] / np.linalg.norm(head[succ[x]]) * np.sqrt(d) for x in xs])
    assert all((w @ head.T).argmax() == succ[x] for x, w in zip(xs, want))  # the LM head reads them right
    fit = np.linalg.lstsq(_rms(embed[xs]), want, rcond=None)[0]  # [D in, D out]
    mtp = {"mtp.fc.weight": np.concatenate([fit.T, np.zeros((d, d))], axis=1).astype(np.float32),  # HF [out, in]
           **{f"mtp.{k}.weight": np.zeros(d, np.float32) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                    "norm")},
           **layer_tensors(tensors, 1, rng, scale_out=0.02)}  # layer 1 is a full-attention one
    _write(path, mtp)
    return path, runner, ckpt, jobs, plain, succ


def _draft(case, swap_halves: bool = False):
    from ferrox_jax.mtp import MtpDraft
    from models.qwen3_5_mtp import load_mtp

    path, runner, ckpt, *_ = case
    model = load_mtp(path, ckpt.config, ckpt.model, jnp.float32)
    if swap_halves:  # fc's rows [embedding | hidden] as [hidden | embedding]: a hidden-first concatenation
        d = ckpt.config.hidden_size
        w = model.fc.get_value()
        model.fc.set_value(jnp.concatenate([w[d:], w[:d]]))
    draft = MtpDraft(model, runner)
    draft.warmup()
    return draft


def _check_same(run, plain, ids) -> float:
    """Tokens equal to the plain run's; returns the largest logprob difference."""
    err = 0.0
    for rid in ids:
        assert run.tokens[rid] == plain.tokens[rid], rid
        err = max(err, float(np.abs(np.subtract(run.logprobs[rid][0], plain.logprobs[rid][0])).max()))
    return err


def test_greedy_identical_alone_and_batched_with_drafts_accepted(case):
    path, runner, ckpt, jobs, plain, _ = case
    draft = _draft(case)
    batched = drive(runner, ckpt.tokenizer, jobs, _spec(), max_rows=MAX_ROWS, draft=draft, state_slots=SLOTS)
    err = _check_same(batched, plain, [j.request_id for j in jobs])
    c = batched.scheduler.speculator.counters
    print(f"k={K} batched: {c.num_accepted_tokens}/{c.num_draft_tokens} drafts accepted, per position "
          f"{c.accepted_per_pos}; steps {batched.num_steps} vs {plain.num_steps}; max |Δlogprob| {err:.1e}")
    assert err <= LOGPROB_ATOL
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens >= c.num_draft_tokens // 2
    assert batched.num_steps < plain.num_steps  # a count of forwards, not a timing
    alone = drive(runner, ckpt.tokenizer, jobs[:1], _spec(1), max_rows=MAX_ROWS, draft=draft, state_slots=SLOTS)
    err = _check_same(alone, plain, ["r0"])
    assert err <= LOGPROB_ATOL
    assert alone.scheduler.speculator.counters.num_accepted_tokens > 0
    assert draft.recompiles_after_warmup == 0


def test_hidden_first_concatenation_keeps_the_output_and_loses_the_drafts(case):
    """Negative control of the construction: fc's halves swapped."""
    path, runner, ckpt, jobs, plain, _ = case
    wrong = drive(runner, ckpt.tokenizer, jobs, _spec(), max_rows=MAX_ROWS, draft=_draft(case, swap_halves=True),
                  state_slots=SLOTS)
    assert _check_same(wrong, plain, [j.request_id for j in jobs]) <= LOGPROB_ATOL
    c = wrong.scheduler.speculator.counters
    print(f"fc halves swapped: {c.num_accepted_tokens}/{c.num_draft_tokens} drafts accepted")
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens <= c.num_draft_tokens // 10


def _reference_logits(w, embed, head, layer, rotary, tokens, hidden, eps, swap=False):
    """vLLM's MTP block in torch: w the `mtp.*` tensors (names after `mtp.`), `layer` a HF
    full-attention decoder layer holding `layers.0.*`. -> (out, logits), causal over the
    sequence (position i reads token x_{i+1} = tokens[i] and the hidden state h_i)."""
    import torch

    def norm(x, weight):  # Qwen3.5's RMSNorm: times (1 + w), in float32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)

    with torch.no_grad():
        t = len(tokens)
        e = norm(torch.tensor(embed)[torch.tensor(tokens)], w["pre_fc_norm_embedding.weight"])
        h = norm(torch.tensor(hidden), w["pre_fc_norm_hidden.weight"])
        x = torch.cat([h, e] if swap else [e, h], -1) @ w["fc.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer(x[None], position_embeddings=rotary(x[None], pos), attention_mask=mask, position_ids=pos)
        x = x[0] if isinstance(x, torch.Tensor) else x[0][0]
        out = norm(x, w["norm.weight"])
        return out.numpy(), (out @ torch.tensor(head).T).numpy()


def _ours(path, ckpt, tokens, hidden):
    from ferrox_jax.kv_cache import create_layout_kv_cache
    from ferrox_jax.mtp import mtp_layout
    from ferrox_jax.runner import block_table_width
    from models.qwen3_5_mtp import load_mtp

    t = len(tokens)
    model = load_mtp(path, ckpt.config, ckpt.model, jnp.float32)
    cache = create_layout_kv_cache(mtp_layout(ckpt.config), 8, 4, jnp.float32)
    tables = np.zeros((t, block_table_width(64, 4)), np.int32)
    tables[:, :3] = [5, 2, 7]  # 12 positions in 3 blocks of 4, out of order
    out, _, _ = model.draft_step(jnp.asarray(tokens, jnp.int32), jnp.arange(t, dtype=jnp.int32), jnp.ones(t, bool),
                                 jnp.asarray(hidden), cache.k[0], cache.v[0], jnp.asarray(tables))
    return np.asarray(out), np.asarray(model.logits(out))


def _compare(name, ours, reference, reference_swapped) -> None:
    (out, logits), (ref_out, ref_logits), (bad_out, _) = ours, reference, reference_swapped
    err = max(float(np.abs(out - ref_out).max()), float(np.abs(logits - ref_logits).max()))
    control = float(np.abs(out - bad_out).max())
    print(f"{name}: max |Δ| (output, logits) vs the torch reference {err:.2e}; hidden-first concatenation {control:.2e}")
    assert err <= LAYER_ATOL and control > 1e-2


def test_mtp_layer_matches_vllms_definition(case, tmp_path):
    """12 positions of one sequence as one-token rows over the block's K/V cache (blocks out of
    order), random `mtp.*` weights (a copy of the checkpoint), against the torch reference."""
    import torch
    from safetensors.numpy import load_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    path, _, ckpt, *_ = case
    folder = tmp_path / "random-mtp"
    shutil.copytree(path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.RandomState(1)
    d = ckpt.config.hidden_size
    mtp = {"mtp.fc.weight": (rng.randn(d, 2 * d) / np.sqrt(2 * d)).astype(np.float32),
           **{f"mtp.{k}.weight": (0.1 * rng.randn(d)).astype(np.float32)
              for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
           **layer_tensors(tensors, 1, rng, scale_out=1.0)}
    _write(folder, mtp)
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = "eager"
    assert cfg.layer_types[1] == "full_attention"
    layer = hf.Qwen3_5DecoderLayer(cfg, layer_idx=1).eval()
    w = {k[len("mtp."):]: torch.tensor(v) for k, v in mtp.items()}
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")})
    tokens, hidden = rng.randint(0, cfg.vocab_size, 12), rng.randn(12, d).astype(np.float32)
    args = (w, tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], layer, hf.Qwen3_5TextRotaryEmbedding(cfg),
            tokens, hidden, cfg.rms_norm_eps)
    _compare("Qwen3.5 MTP", _ours(folder, ckpt, tokens, hidden), _reference_logits(*args),
             _reference_logits(*args, swap=True))


def test_the_model_loads_beside_the_block_and_a_checkpoint_without_it_is_refused(case):
    """The main model's loader skips `mtp.*` (same weights as the checkpoint without it);
    `--speculative mtp` on a checkpoint without the block is refused naming what is missing."""
    from ferrox_jax.mtp import check_mtp
    from models.loader import load_checkpoint, open_checkpoint

    path, _, ckpt, *_ = case
    again = load_checkpoint(str(path))
    assert np.array_equal(np.asarray(again.model.lm_head.get_value()), np.asarray(ckpt.model.lm_head.get_value()))
    assert check_mtp(EngineConfig(model=str(path), speculative=_spec()), open_checkpoint(str(path)), 1)
    bare = path.parent / "no-mtp"
    config = EngineConfig(model=str(bare), speculative=_spec())
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer \(no mtp\.fc\.weight"):
        check_mtp(config, open_checkpoint(str(bare)), 1)
    assert not check_mtp(dataclasses.replace(config, speculative=None), open_checkpoint(str(bare)), 1)


def test_qwen3_next_block_with_experts_matches_its_reference(tmp_path):
    """Qwen3-Next: the block's decoder layer has the model's experts and shared expert. Its
    `mtp.layers.0.*` are a copy of the main model's full-attention layer 3 (per-expert names,
    as the checkpoints ship them), so the reference's layer is the HF model's own layer 3."""
    import torch
    from safetensors.numpy import load_file

    from models.loader import load_checkpoint

    config = transformers.Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=128,
        max_position_embeddings=512, tie_word_embeddings=False)
    config.architectures = ["Qwen3NextForCausalLM"]
    path = fc.make_checkpoint(tmp_path / "tiny-qwen3-next", config)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.RandomState(2)
    d = config.hidden_size
    mtp = {"mtp.fc.weight": (rng.randn(d, 2 * d) / np.sqrt(2 * d)).astype(np.float32),
           **{f"mtp.{k}.weight": (0.1 * rng.randn(d)).astype(np.float32)
              for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
           **{"mtp.layers.0." + k.split(".", 3)[3]: v for k, v in tensors.items() if k.startswith("model.layers.3.")}}
    assert any(".mlp.experts.3." in k for k in mtp) and "mtp.layers.0.mlp.shared_expert_gate.weight" in mtp
    _write(path, mtp)
    ckpt = load_checkpoint(str(path))
    hf_model = fc.hf_model(path)
    hf_model.config._attn_implementation = "eager"
    w = {k[len("mtp."):]: torch.tensor(v) for k, v in mtp.items()}
    tokens, hidden = rng.randint(0, config.vocab_size, 12), rng.randn(12, d).astype(np.float32)
    args = (w, tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], hf_model.model.layers[3],
            hf_model.model.rotary_emb, tokens, hidden, config.rms_norm_eps)
    _compare("Qwen3-Next MTP", _ours(path, ckpt, tokens, hidden), _reference_logits(*args),
             _reference_logits(*args, swap=True))


def test_served_through_the_engine_builder(case):
    """`--speculative mtp` from the engine builder (the block read from the folder, its K/V in
    the block budget, 1 + k state entries) behind the real server: the plain greedy reply,
    drafts accepted and counted, no compile after warm-up."""
    path, _, ckpt, jobs, plain, _ = case
    text, stats = serve_one_greedy_completion(path, _spec(1), jobs[0].prompt_token_ids)
    assert text == ckpt.tokenizer.decode(plain.tokens["r0"][0])
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["recompiles_after_warmup"] == 0
