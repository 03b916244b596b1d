"""`--speculative mtp`: a tiny DeepSeek-V3 checkpoint with a multi-token-prediction layer
written into its safetensors under the released checkpoints' names
(`model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}`
plus a full decoder layer: MLA and MoE), drafting for the target through the real scheduler,
runner and MTP draft (tests/support/spec_driver.py runs the owner loop's tick).

How its drafts are made often right: the layer reads only the target's hidden state h_i
(eh_proj's embedding half is zero, its hidden half the identity), its decoder layer adds a
small random term (o_proj and the expert / shared down-projections scaled by 0.02, so its
attention over its own latent cache and its MoE run and matter a little), and its head is
the target's LM head with its columns permuted: column succ(x) holds lm_head's column x,
where succ is the successor map of the plain greedy output (tiny random models fall into a
cycle). h_i's top token under lm_head is x_{i+1}, so the layer's top token is succ(x_{i+1}),
which is x_{i+2} wherever the text cycles. Its second draft reuses the layer on its own
output and repeats the first, so with k > 1 the second draft is mostly wrong (exactness
does not care).

Checks: greedy identical to plain decoding alone and batched, k = 1 and 3, drafts accepted;
seeded sampling identical; no compile after warm-up; the negative control (after an
accepted draft, the layer fed the hidden state one position too early) is still identical
but accepts fewer; a
checkpoint without the layer is refused at load with a message naming it; tensor parallelism
is accepted (its split is run by tests/system/test_family_sharding.py) and multi-host is
refused with the reason. And the layer
itself against a torch reference built from transformers' own DeepSeek-V3 decoder layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers

from ferrox_jax.config import SpeculativeConfig
from ferrox_jax.request import Job, RowSampling
from tests.support import family_checks as fc
from tests.support.spec_driver import drive

SHAPE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             max_position_embeddings=256, tie_word_embeddings=False, num_nextn_predict_layers=1)
MAX_ROWS = 4
GREEDY = RowSampling(temperature=0.0)


def _runner(path, hidden: bool = True):
    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint

    ckpt = load_checkpoint(str(path))
    ckpt.model.keeps_step_hidden = hidden
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, max_rows=MAX_ROWS)
    return ModelRunner(ckpt.model, num_blocks=64, block_size=4, max_rows=spec.step_rows(MAX_ROWS),
                       max_chunk_tokens=32, max_context=128), ckpt


def _jobs(prompts, max_tokens=24, sampling=GREEDY):
    return [Job(request_id=f"r{i}", prompt_token_ids=tuple(p), max_tokens=max_tokens, sampling=sampling)
            for i, p in enumerate(prompts)]


class Tokens(dict):
    """request id -> per row, the tokens; and the target steps the run took."""

    steps = 0


def _successors(runs) -> dict[int, int]:
    succ: dict[int, int] = {}
    for rows in runs.values():
        for tokens in rows:
            for x, y in zip(tokens[4:], tokens[5:]):
                succ.setdefault(x, y)
    return succ


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(checkpoint folder, runner, checkpoint, prompts, plain greedy tokens)."""
    from safetensors.numpy import load_file, save_file

    path = fc.make_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-deepseek-v3-mtp",
                              transformers.DeepseekV3Config(**SHAPE))
    runner, ckpt = _runner(path)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, ckpt.config.vocab_size, n).tolist() for n in (9, 14, 6)]
    plain_run = drive(runner, ckpt.tokenizer, _jobs(prompts), None, max_rows=MAX_ROWS)
    plain = Tokens(plain_run.tokens)
    plain.steps = plain_run.num_steps
    succ = _successors(plain)

    tensors = load_file(str(path / "model.safetensors"))
    v, d, n = ckpt.config.vocab_size, ckpt.config.hidden_size, ckpt.config.num_layers
    pre = {y: x for x, y in reversed(list(succ.items()))}  # column y <- lm_head column pre[y]
    rest = iter(sorted(set(range(v)) - set(pre.values())))
    columns = [pre[y] if y in pre else next(rest) for y in range(v)]
    lm_head = tensors["lm_head.weight"]  # [V, D]
    mtp = {"enorm.weight": np.ones(d), "hnorm.weight": np.ones(d),
           "eh_proj.weight": np.concatenate([np.zeros((d, d)), np.eye(d)], axis=1),  # HF [out, in]: [D, 2D]
           "shared_head.norm.weight": np.ones(d), "shared_head.head.weight": lm_head[columns],
           "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    for name, arr in tensors.items():  # a full decoder layer: the last one's shapes, fresh values
        if name.startswith(f"model.layers.{n - 1}."):
            suffix = name.split(".", 3)[3]
            value = rng.randn(*arr.shape) * float(arr.std() or 0.02) if arr.ndim > 1 else arr
            if suffix.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * 0.02
            mtp[suffix] = value
    tensors.update({f"model.layers.{n}.{k}": np.asarray(a, np.float32) for k, a in mtp.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, runner, ckpt, prompts, plain


def _mtp(case):
    from ferrox_jax.mtp import MtpDraft
    from models.deepseek_mtp import load_mtp

    path, runner, ckpt, *_ = case
    return MtpDraft(load_mtp(path, ckpt.config, ckpt.model, ckpt.model.dtype), runner)


def _spec(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, max_rows=MAX_ROWS)


def test_greedy_identical_alone_and_batched_with_drafts_accepted(case):
    """k = 3 here; the negative control's reference run is k = 1."""
    path, runner, ckpt, prompts, plain = case
    k = 3
    draft = _mtp(case)
    draft.warmup()
    batched = drive(runner, ckpt.tokenizer, _jobs(prompts), _spec(k), max_rows=MAX_ROWS, draft=draft)
    assert batched.tokens == plain
    c = batched.scheduler.speculator.counters
    print(f"k={k}: {c.num_accepted_tokens}/{c.num_draft_tokens} drafts accepted over {c.num_drafts} verifications, "
          f"per position {c.accepted_per_pos}")
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > c.num_draft_tokens // (3 * k)
    print(f"target steps: {batched.num_steps} with drafts, {plain.steps} without")
    assert batched.num_steps < plain.steps  # a count of forwards, not a timing
    alone = drive(runner, ckpt.tokenizer, _jobs(prompts[:1]), _spec(k), max_rows=MAX_ROWS, draft=draft)
    assert alone.tokens["r0"] == plain["r0"]
    assert alone.scheduler.speculator.counters.num_accepted_tokens > 0
    assert draft.recompiles_after_warmup == 0


def test_seeded_sampling_identical(case):
    path, runner, ckpt, prompts, _ = case
    sampling = RowSampling(temperature=0.7, seed=11)
    off = drive(runner, ckpt.tokenizer, _jobs(prompts, sampling=sampling), None, max_rows=MAX_ROWS)
    on = drive(runner, ckpt.tokenizer, _jobs(prompts, sampling=sampling), _spec(2), max_rows=MAX_ROWS,
               draft=_mtp(case))
    assert on.tokens == off.tokens
    assert on.scheduler.speculator.counters.num_draft_tokens > 0


def test_a_wrong_hidden_state_position_keeps_the_output_and_loses_acceptance(case):
    """Negative control: after an accepted draft the layer is fed the hidden state of the
    step's first verified position instead of the last accepted one (one position early)."""
    path, runner, ckpt, prompts, plain = case
    right = drive(runner, ckpt.tokenizer, _jobs(prompts), _spec(1), max_rows=MAX_ROWS, draft=_mtp(case))
    wrong_draft = _mtp(case)
    wrong_draft.hidden_position = lambda row: min(
        position for row_id, position in wrong_draft._kept_at if row_id == row.row_id)
    wrong = drive(runner, ckpt.tokenizer, _jobs(prompts), _spec(1), max_rows=MAX_ROWS, draft=wrong_draft)
    assert wrong.tokens == plain == right.tokens
    good, bad = right.scheduler.speculator.counters, wrong.scheduler.speculator.counters
    print(f"accepted: right hidden {good.num_accepted_tokens}/{good.num_draft_tokens}, "
          f"first verified position {bad.num_accepted_tokens}/{bad.num_draft_tokens}")
    # deterministic (greedy, fixed weights): 18 vs 13 of 29 measured; the text's runs of one
    # repeated token (r2) are drafted right from any position's hidden state
    assert bad.num_draft_tokens > 0 and bad.num_accepted_tokens <= good.num_accepted_tokens - 4


def test_mtp_layer_matches_a_transformers_reference(case):
    """The layer (models/deepseek_mtp.py) over 12 positions of one sequence, one-token rows
    over its latent cache, against torch: enorm / hnorm / eh_proj / shared_head written
    out, the decoder layer transformers' own DeepseekV3DecoderLayer with the MTP weights,
    causal. Negative control: the concat order of eh_proj's input swapped."""
    import jax.numpy as jnp
    import torch
    from safetensors.numpy import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from ferrox_jax.runner import block_table_width
    from models.deepseek_mtp import load_mtp

    path, _, ckpt, *_ = case
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    n, t = cfg.num_hidden_layers, 12
    prefix = f"model.layers.{n}."
    w = {k[len(prefix):]: torch.tensor(v) for k, v in load_file(str(path / "model.safetensors")).items()
         if k.startswith(prefix)}
    layer = hf.DeepseekV3DecoderLayer(cfg, layer_idx=n).eval()
    state = {k: v for k, v in w.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                               "post_attention_layernorm") and ".experts." not in k}
    experts = range(cfg.n_routed_experts)  # transformers 5 holds them fused: [E, 2F, D] and [E, D, F]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"],
                                                                w[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(state)
    rng = np.random.RandomState(1)
    tokens = rng.randint(0, cfg.vocab_size, t)
    hidden = rng.randn(t, cfg.hidden_size).astype(np.float32)

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def reference(swap=False):
        with torch.no_grad():
            e = w["embed_tokens.weight"][torch.tensor(tokens)]
            e[0] = 0.0  # position 0
            parts = [norm(e, w["enorm.weight"]), norm(torch.tensor(hidden), w["hnorm.weight"])]
            x = torch.cat(parts[::-1] if swap else parts, -1) @ w["eh_proj.weight"].T
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            x = layer(x[None], attention_mask=mask, position_ids=pos,
                      position_embeddings=hf.DeepseekV3RotaryEmbedding(cfg)(x[None], pos))[0]
            return (norm(x, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T).numpy()

    model = load_mtp(path, ckpt.config, ckpt.model, jnp.float32)
    width = block_table_width(64, 4)
    tables = np.zeros((t, width), np.int32)
    tables[:, :3] = [5, 2, 7]  # 12 positions in 3 blocks of 4, out of order
    x, _ = model(jnp.asarray(tokens, jnp.int32), jnp.arange(t, dtype=jnp.int32), jnp.ones(t, bool),
                 jnp.asarray(hidden), jnp.zeros((1, 8, 4, ckpt.config.kv_lora_rank + ckpt.config.qk_rope_head_dim)),
                 jnp.asarray(tables))
    ours = np.asarray(model.logits(x))
    err, control = float(np.abs(ours - reference()).max()), float(np.abs(ours - reference(swap=True)).max())
    print(f"MTP layer: max |Δlogit| vs the transformers reference {err:.2e}; swapped eh_proj input {control:.2e}")
    assert err < 1e-4 and control > 1e-2


def test_checkpoint_without_mtp_layer_is_refused(tmp_path):
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.mtp import check_mtp
    from models.loader import open_checkpoint

    path = fc.make_checkpoint(tmp_path / "no-mtp", transformers.DeepseekV3Config(
        **{**SHAPE, "num_nextn_predict_layers": 0}))
    config = EngineConfig(model=str(path), speculative=_spec(1))
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer .*model\.layers\.2\.eh_proj"):
        check_mtp(config, open_checkpoint(str(path)), 1)
    assert not check_mtp(dataclasses.replace(config, speculative=None), open_checkpoint(str(path)), 1)


def test_tensor_parallelism_is_served_and_multi_host_refused_with_the_reason(tmp_path, monkeypatch):
    """The layer splits over the mesh (tests/system/test_family_sharding.py runs it at tp 2):
    accepted at tp 2; a tp that does not divide hidden_size (fc's output columns) and a
    multi-process group (the step channel does not carry the layer's calls) are refused."""
    import jax

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.mtp import check_mtp
    from models.loader import open_checkpoint
    from tests.support.mtp_tp_probe import deepseek_mtp_checkpoint

    path = deepseek_mtp_checkpoint(tmp_path / "ds-mtp")
    config = EngineConfig(model=str(path), speculative=_spec(1))
    assert check_mtp(config, open_checkpoint(str(path)), 2)
    with pytest.raises(ValueError, match=r"tensor parallelism 3 does not divide the model's hidden_size 64"):
        check_mtp(config, open_checkpoint(str(path)), 3)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"not served across processes yet \(multi-host\)"):
        check_mtp(config, open_checkpoint(str(path)), 2)


def test_served_end_to_end_with_its_counters(case):
    """The engine builder's path (`--speculative mtp` read from the checkpoint folder, its
    latent cache in the block budget) behind the real server: the greedy text of plain
    decoding, and the drafts counted in /admin/stats and /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from api.app import create_app
    from api.config import ServerConfig
    from tests.support.server_harness import ServerThread, tiny_engine

    path, _, ckpt, prompts, plain = case
    engine = tiny_engine(path, block_size=4, kv_blocks=64, max_seqs=MAX_ROWS, prefill_chunk=32, max_context=128,
                         speculative=_spec(1))
    with ServerThread(create_app(engine, ServerConfig())) as url:
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": engine.model_name, "prompt": prompts[0], "max_tokens": 24, "temperature": 0}).json()
        assert reply["choices"][0]["text"] == ckpt.tokenizer.decode(plain["r0"][0])
        stats = httpx.get(f"{url}/admin/stats").json()
        metrics = httpx.get(f"{url}/metrics").text
    print({k: v for k, v in stats.items() if k.startswith("spec_decode")})
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["recompiles_after_warmup"] == 0
    values = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == stats["spec_decode_num_accepted_tokens"]


def test_flags_and_vllms_json_give_the_same_config():
    from api import cli

    def parse(argv):
        return cli.speculative_config(cli.build_parser({}).parse_args(["serve", *argv]))

    flags = parse(["--speculative", "mtp", "--num-speculative-tokens", "1"])
    json_form = parse(["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'])
    assert flags == json_form and flags.method == "mtp" and flags.num_speculative_tokens == 1
    with pytest.raises(ValueError, match="only it takes one"):
        SpeculativeConfig(method="mtp", draft_model="/m/small")
