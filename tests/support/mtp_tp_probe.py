"""`--speculative mtp` under tensor parallelism, run by the families sharding probe
(tests/support/sharding_probe.py `families --tp2-mtp QWEN DEEPSEEK`, a run of its own; asserted
by tests/system/test_family_sharding.py). The checkpoints' MTP blocks are written by the test
(`write_qwen_mtp_block`, `deepseek_mtp_checkpoint`) under the released checkpoints' names.

For each checkpoint (the families probe's tiny Qwen3.5, here with an `mtp.*` block, and a tiny
DeepSeek-V3 with its MTP layer: latent attention and MoE): the greedy replies at tp 2 with
the MTP draft against one device without speculation (tokens, logprobs), the draft's counters
against the same draft on one device (the drafts themselves: the same ones proposed and
accepted), where the layer's weights and cache landed, the collectives of its compiled steps,
and 0 compiles after its warm-up (by our count and by the jitted functions' own caches).

How its drafts are made right: as tests/models/test_mtp_qwen3_5.py (Qwen: fc's embedding half
fitted by least squares so that each token x of the plain replies maps to the LM head's column
of the token that follows it there, the hidden half zero) and tests/models/test_mtp.py
(DeepSeek: eh_proj reads only the hidden state, the layer's head is the LM head with its
columns permuted along the replies' successor map), both on the one-device plain replies, in
the probe, before the draft is placed on the mesh.

Negative controls, each on the tp 2 mesh (the same draft, the weight replaced in place),
each with the output unchanged (verification is exact) and the acceptance lost: Qwen's fc
with each device's output columns those of the next device (the columns split out of order);
DeepSeek's hidden state read from the wrong shard (eh_proj's hidden rows rolled by one
device's share: each device's part of h meets the next device's rows).
"""

from __future__ import annotations

import re

import numpy as np

MAX_ROWS, K = 2, 3
GEOMETRY = dict(num_blocks=64, block_size=8, max_chunk_tokens=8, max_context=128)
MAX_TOKENS = 14
DEEPSEEK_SHAPE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
                      tie_word_embeddings=False, num_nextn_predict_layers=1)
LAYER_SCALE = 0.02  # the MTP decoder layer's output projections: it runs and matters a little


# ---- the checkpoints (the test's side) ---------------------------------------------------------
def _fresh_layer(tensors, prefix, rng, zero_norms: bool) -> dict[str, np.ndarray]:
    """{suffix: fresh values} of the layer under `prefix`: random matrices of its std, the
    output projections times LAYER_SCALE; norms zero-centred (`zero_norms`, Qwen's 1 + w) or kept."""
    out = {}
    for name, arr in tensors.items():
        if name.startswith(prefix):
            suffix = name[len(prefix):]
            if arr.ndim > 1:
                value = rng.randn(*arr.shape) * (float(arr.std()) or 0.02)
            else:
                value = 0.1 * rng.randn(*arr.shape) if zero_norms else arr
            if suffix.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * LAYER_SCALE
            out[suffix] = np.asarray(value, np.float32)
    return out


def write_qwen_mtp_block(path, full_attention_layer: int = 1) -> None:
    """`mtp.*` into the Qwen3.5 checkpoint at `path`: the decoder layer of a full-attention
    layer's shapes, norms w = 0 (times 1), fc random (the probe fits it)."""
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    d = tensors["model.embed_tokens.weight"].shape[1]
    rng = np.random.RandomState(0)
    layer = _fresh_layer(tensors, f"model.layers.{full_attention_layer}.", rng, zero_norms=True)
    mtp = {"mtp.fc.weight": (0.1 * rng.randn(d, 2 * d)).astype(np.float32),
           **{f"mtp.{k}.weight": np.zeros(d, np.float32) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                    "norm")},
           **{f"mtp.layers.0.{k}": v for k, v in layer.items()}}
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})


def deepseek_mtp_checkpoint(path):
    """A tiny DeepSeek-V3 (tests/models/test_mtp.py's shape) with its MTP layer at index
    num_hidden_layers: eh_proj [0 | I] (the hidden state only), norms 1, the head the LM head
    (the probe permutes it), a fresh decoder layer of the last layer's shapes."""
    import transformers
    from safetensors.numpy import load_file, save_file

    from tests.support import family_checks as fc

    fc.make_checkpoint(path, transformers.DeepseekV3Config(**DEEPSEEK_SHAPE))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    n = DEEPSEEK_SHAPE["num_hidden_layers"]
    d = DEEPSEEK_SHAPE["hidden_size"]
    mtp = {"enorm.weight": np.ones(d), "hnorm.weight": np.ones(d),
           "eh_proj.weight": np.concatenate([np.zeros((d, d)), np.eye(d)], axis=1),  # HF [out, in]
           "shared_head.norm.weight": np.ones(d), "shared_head.head.weight": tensors["lm_head.weight"],
           "embed_tokens.weight": tensors["model.embed_tokens.weight"],
           **_fresh_layer(tensors, f"model.layers.{n - 1}.", np.random.RandomState(1), zero_norms=False)}
    tensors.update({f"model.layers.{n}.{k}": np.asarray(a, np.float32) for k, a in mtp.items()})
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


# ---- the probe's side -----------------------------------------------------------------------------
def _jobs(vocab_size):
    from ferrox_jax.request import Job, RowSampling

    rng = np.random.RandomState(0)
    return [Job(request_id=f"r{i}", prompt_token_ids=tuple(rng.randint(3, vocab_size, n).tolist()),
                max_tokens=MAX_TOKENS, sampling=RowSampling(temperature=0.0, logprobs=1))
            for i, n in enumerate((9, 14, 6))]


def _successors(run) -> dict[int, int]:
    succ: dict[int, int] = {}
    for rows in run.tokens.values():
        for x, y in zip(rows[0], rows[0][1:]):
            succ.setdefault(x, y)
    return succ


def _value(var):
    return np.asarray(var.get_value())


def fit_qwen_block(model, succ, embed, head) -> None:
    """fc's embedding half fitted (module docstring); embed [V, D], head [D, V] numpy."""
    d = embed.shape[1]
    xs = sorted(succ)
    cols = head[:, [succ[x] for x in xs]].T  # [n, D]: the LM head's column of succ(x)
    want = cols / np.linalg.norm(cols, axis=1, keepdims=True) * np.sqrt(d)
    e = embed[xs]
    e = e / np.sqrt((e * e).mean(-1, keepdims=True) + model.cfg.rms_norm_eps)
    fit = np.linalg.lstsq(e, want, rcond=None)[0]  # [D in, D out]
    model.fc.set_value(np.concatenate([fit, np.zeros((d, d))]).astype(np.float32))  # ours [2D, D]


def permute_deepseek_head(model, succ) -> None:
    """The layer's head column succ(x) <- the LM head's column x (tests/models/test_mtp.py)."""
    head = _value(model.head)  # [D, V]
    v = head.shape[1]
    pre = {y: x for x, y in reversed(list(succ.items()))}
    rest = iter(sorted(set(range(v)) - set(pre.values())))
    model.head.set_value(head[:, [pre[y] if y in pre else next(rest) for y in range(v)]])


def _rolled_columns(w, shards):
    """[.., D] -> each device's share of the last axis the next device's."""
    return np.roll(w, w.shape[-1] // shards, axis=-1)


def _rolled_hidden_rows(w, shards):
    """eh_proj [2D, D]: the hidden half's rows rolled by one device's share."""
    d = w.shape[1]
    return np.concatenate([w[:d], np.roll(w[d:], d // shards, axis=0)])


def collectives(text):
    found = re.findall(r"= (\S+?)\{[^}]*\} (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(",
                       text)
    return [(op, shape) for shape, op in found]


def draft_collectives(draft, rows: int) -> dict:
    """{"follow": [...], "propose": [...]} of the draft's compiled steps at `rows` one-token rows."""
    import jax.numpy as jnp

    from ferrox_jax.host_batch import SamplingArrays

    tokens, positions, valid, tables = draft._padding(rows)
    cache = (draft.cache.k[0], draft.cache.v[0])
    hidden = draft._steps.place(jnp.zeros((rows, draft.hidden_size), jnp.float32))
    follow = draft._steps.follow.lower(draft.graphdef, draft.state, *cache, tokens, positions, valid, tables,
                                       hidden, np.zeros(draft._keep, np.int32))
    propose = draft._steps.propose.lower(draft.graphdef, draft.state, *cache, tokens, positions, valid, tables,
                                         hidden, SamplingArrays.padding(rows, draft.vocab_size))
    return {"follow": collectives(follow.compile().as_text()), "propose": collectives(propose.compile().as_text())}


def _jit_cache_sizes(draft) -> list[int]:
    return [f._cache_size() for f in (draft._steps.follow, draft._steps.propose, draft._steps.gather)]


def _counters(run) -> dict:
    c = run.scheduler.speculator.counters
    return {"drafted": c.num_draft_tokens, "accepted": c.num_accepted_tokens, "per_position": c.accepted_per_pos,
            "steps": run.num_steps}


def _compare(run, ref) -> dict:
    err = 0.0
    for key, rows in ref.logprobs.items():
        a, b = run.logprobs[key][0], rows[0]
        n = min(len(a), len(b))
        err = max(err, float(np.abs(np.subtract(a[:n], b[:n])).max()) if n else 0.0)
    return {"same_tokens": run.tokens == ref.tokens, "logprob_err": err}


def case_mtp_tp(path: str, control) -> dict:
    """One checkpoint with an MTP block (module docstring): tp 2 with the draft against one
    device; `control`: (the block's weight, its wrong split: f(array, shards)) for the control."""
    import jax

    from ferrox_jax.config import SpeculativeConfig
    from ferrox_jax.mtp import MtpDraft, _reader
    from ferrox_jax.sharding import describe_sharding
    from ferrox_jax.state_pool import state_entries
    from models.loader import load_checkpoint
    from tests.support.sharding_probe import _runner
    from tests.support.spec_driver import drive

    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    ckpt.model.keeps_step_hidden = True
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=K, max_rows=MAX_ROWS)
    rows = spec.step_rows(MAX_ROWS)
    recurrent = bool(cfg.recurrent_specs())
    slots = rows + 1 if recurrent else 0
    kw = dict(max_rows=rows, state_entries=state_entries(spec) if recurrent else 1, **GEOMETRY)
    one = _runner(ckpt.model, 1, **kw)
    jobs = _jobs(cfg.vocab_size)
    plain = drive(one, ckpt.tokenizer, jobs, None, max_rows=MAX_ROWS, state_slots=slots)
    succ = _successors(plain)
    reader = _reader(cfg)

    def block():
        model = reader.load_mtp(path, cfg, ckpt.model, ckpt.model.dtype)
        if reader.__name__.endswith("qwen3_5_mtp"):
            fit_qwen_block(model, succ, _value(ckpt.model.embed), _value(
                ckpt.model.tied_lm_head if cfg.tie_word_embeddings else ckpt.model.lm_head))
        else:
            permute_deepseek_head(model, succ)
        return model

    one_mtp = drive(one, ckpt.tokenizer, jobs, spec, max_rows=MAX_ROWS, draft=MtpDraft(block(), one),
                    state_slots=slots)
    tp = _runner(ckpt.model, 2, **kw)
    draft = MtpDraft(block(), tp)
    draft.warmup()
    warm_caches = _jit_cache_sizes(draft)
    run = drive(tp, ckpt.tokenizer, jobs, spec, max_rows=MAX_ROWS, draft=draft, state_slots=slots)
    out = {**_compare(run, plain), "counters": _counters(run), "one_device_counters": _counters(one_mtp),
           "one_device_same_tokens": one_mtp.tokens == plain.tokens, "plain_steps": plain.num_steps,
           "recompiles_after_warmup": draft.recompiles_after_warmup,
           "jit_caches": [warm_caches, _jit_cache_sizes(draft)],
           "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    state = draft.state
    names = {"fc", "eh_proj", "head", "embed", "enorm"}
    placed = {name: describe_sharding(state[name].get_value()) for name in names if name in state}
    layer = state["layer"]
    placed.update({f"layer.{name}": describe_sharding(layer[name].get_value()) for name in
                   ("q_proj", "o_proj", "q_b_proj", "kv_b_proj", "kv_a_proj", "down_proj", "experts_gate",
                    "experts_down", "shared_down") if name in layer})
    placed["cache_k"] = describe_sharding(draft.cache.k[0])
    placed["target_kv_k"] = describe_sharding(tp.kv_cache.k[-1])
    out["placement"] = placed
    out["collectives"] = draft_collectives(draft, 1)
    name, mutate = control
    var = draft.state[name]  # the same draft, its weight replaced in place: nothing compiles again
    var.set_value(jax.device_put(mutate(np.asarray(var.get_value()), 2), var.get_value().sharding))
    bad = drive(tp, ckpt.tokenizer, jobs, spec, max_rows=MAX_ROWS, draft=draft, state_slots=slots)
    out["control"] = {**_compare(bad, plain), "counters": _counters(bad)}
    return out


QWEN_CONTROL = ("fc", _rolled_columns)
DEEPSEEK_CONTROL = ("eh_proj", _rolled_hidden_rows)


def case_mtp(qwen: str, deepseek: str) -> dict:
    return {"qwen3_5": case_mtp_tp(qwen, QWEN_CONTROL), "deepseek_v3": case_mtp_tp(deepseek, DEEPSEEK_CONTROL)}


if __name__ == "__main__":  # a direct run: python tests/support/mtp_tp_probe.py ROOT (writes both checkpoints)
    import json
    import os
    import sys
    from pathlib import Path

    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    root = Path(sys.argv[1])
    from tests.system.test_family_sharding import qwen3_5_checkpoint

    qwen = qwen3_5_checkpoint(root)
    write_qwen_mtp_block(qwen)
    ds = deepseek_mtp_checkpoint(root / "deepseek_v3_mtp")
    which = sys.argv[2] if len(sys.argv) > 2 else "both"
    got = {}
    if which in ("both", "qwen"):
        got["qwen3_5"] = case_mtp_tp(str(qwen), QWEN_CONTROL)
    if which in ("both", "deepseek"):
        got["deepseek_v3"] = case_mtp_tp(str(ds), DEEPSEEK_CONTROL)
    print(json.dumps(got, default=str, indent=1))
