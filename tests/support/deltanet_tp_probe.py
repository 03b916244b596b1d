"""Tensor parallelism for the Gated DeltaNet families (Qwen3.5, Qwen3-Next, Qwen3.5-MoE), run inside the
families sharding probe's subprocess (tests/support/sharding_probe.py `families ... --tp2-state
DIR...`; asserted by tests/system/test_family_sharding.py).

Each checkpoint at tp 2 against one device over two rows in one step: a prefill in two
chunks (the second continues each row's conv and recurrent state from its slot), then greedy
decode steps with both rows batched; where the layer's weights and the state pool landed;
the collectives of a compiled one-row decode step. With `control=True` (the first checkpoint)
also 0 recompiles after warm-up over a mixed workload, and the negative controls: each
device's conv channels grouped with the next device's value heads (a value head beside the
wrong key head), which the parity must catch; and the channels left in HF's order, whose
decode step the collectives check must catch moving channels between devices.

The first checkpoint (Qwen3.5) also speculates at tp 2 (`speculation_tp`): prompt lookup over
repetitive prompts, two rows of 1 + k verified tokens a step, against one device without
speculation, token for token and logprob for logprob; the pool's entries split as its
states and its positions replicated; 0 recompiles after warm-up; the verification step's
collectives those of a plain step. Its control reads the wrong entry (the states after every
verified token, rejected drafts included) and must change the reply.
"""

from __future__ import annotations

import re

import numpy as np

CHUNKS = ((0, 11), (11, 19))  # row 0's prompt in two chunks; row 1's is 13 tokens: (0, 8), (8, 13)
DECODE_STEPS = 4


def _plans(chunks, starts, blocks):
    from ferrox_jax.plan import RowPlan

    return [RowPlan(row_id=i, token_ids=tuple(c), start_pos=s, block_ids=blocks[i], sample=False, state_slot=i + 1)
            for i, (c, s) in enumerate(zip(chunks, starts))]


def two_rows_logits(runner, prompts):
    """(prefill f32[19 + 13 positions, V], the rows' concatenated; decode f32[steps, 2, V]; tokens)."""
    blocks = [tuple(range(1 + 8 * i, 9 + 8 * i)) for i in range(2)]
    spans = [CHUNKS, ((0, 8), (8, 13))]
    prefill = [[], []]
    for step in range(2):
        cut = [s[step] for s in spans]
        for i, logits in enumerate(runner.run_logits(_plans([p[a:b] for p, (a, b) in zip(prompts, cut)],
                                                           [a for a, _ in cut], blocks))):
            prefill[i].append(logits)
    prefill = [np.concatenate(p) for p in prefill]
    seqs = [list(p) + [int(prefill[i][-1].argmax())] for i, p in enumerate(prompts)]
    decode = []
    for _ in range(DECODE_STEPS):
        out = runner.run_logits(_plans([s[-1:] for s in seqs], [len(s) - 1 for s in seqs], blocks))
        decode.append(np.stack([o[-1] for o in out]))
        for i, o in enumerate(out):
            seqs[i].append(int(o[-1].argmax()))
    return np.concatenate(prefill), np.stack(decode), seqs


def _misgrouped(channel_order):
    """The control's channel order: device d's q and k heads beside device d + 1's value heads."""

    def order_of(spec, shards):
        order = channel_order(spec, shards).reshape(shards, -1)
        kd = 2 * spec.key_dim // shards
        return np.concatenate([order[:, :kd], np.roll(order[:, kd:], 1, axis=0)], axis=1).reshape(-1)

    return order_of


def collectives(runner, rows=1):
    """[(op, result shape)] of the compiled decode step of `rows` rows, as the HLO text lists them."""
    text = runner._executable(("forward", rows, 0, 0)).as_text()
    found = re.findall(r"= (\S+?)\{[^}]*\} (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(",
                       text)
    return [(op, shape) for shape, op in found]


def case_state_tp(path, control=False):
    """One checkpoint at tp 2 against one device (module docstring); with `control`, prompt
    lookup at tp 2 too (`speculation_tp`)."""
    from ferrox_jax.sharding import describe_sharding
    from models import deltanet_groups as deltanet
    from models.loader import load_checkpoint
    from tests.support.sharding_probe import _runner, mixed_workload

    ckpt = load_checkpoint(path)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, ckpt.config.vocab_size, n).tolist() for n in (19, 13)]
    ref = two_rows_logits(_runner(ckpt.model, 1), prompts)
    runner = _runner(ckpt.model, 2)
    got = two_rows_logits(runner, prompts)
    out = {"parity": {"prefill_err": float(np.abs(got[0] - ref[0]).max()),
                      "decode_err": float(np.abs(got[1] - ref[1]).max()),
                      "same_greedy": got[2] == ref[2]}}
    layer = runner.state["layers"][0]  # a DeltaNet layer in both tiny checkpoints
    states = runner.kv_cache.states
    out["placement"] = {name: describe_sharding(layer[name][...]) for name in layer
                        if name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz",
                                    "in_proj_ba", "conv_weight", "A_log", "dt_bias", "gate_norm", "out_proj",
                                    "experts_gate", "experts_down", "shared_gate", "shared_down")}
    out["placement"]["conv_pool"] = describe_sharding(states.conv[0])
    out["placement"]["recurrent_pool"] = describe_sharding(states.recurrent[0])
    if control:  # the first checkpoint only: warm-up compiles every shape (the costly part)
        runner.warmup()
        mixed_workload(runner)
        out["recompiles_after_warmup"] = runner.recompiles_after_warmup
        out["recurrent_pool_after_workload"] = describe_sharding(runner.kv_cache.states.recurrent[0])
    out["collectives"] = collectives(runner)
    out["num_layers"], out["hidden_size"], out["vocab_size"] = (ckpt.config.num_layers, ckpt.config.hidden_size,
                                                             ckpt.config.vocab_size)
    if control:
        out["speculation"] = speculation_tp(path, runner)
        real = deltanet.channel_order
        deltanet.channel_order = _misgrouped(real)
        try:
            bad = two_rows_logits(_runner(load_checkpoint(path).model, 2), prompts)
        finally:
            deltanet.channel_order = real
        out["misgrouped"] = {"prefill_err": float(np.abs(bad[0] - ref[0]).max()),
                             "decode_err": float(np.abs(bad[1] - ref[1]).max())}
        # HF's q | k | v order split as it is: still correct (XLA moves the channels), not local
        from ferrox_jax import runner as runner_module

        real_grouping = runner_module.group_for_devices
        runner_module.group_for_devices = lambda model, shards: model
        try:
            out["ungrouped_collectives"] = collectives(_runner(load_checkpoint(path).model, 2))
        finally:
            runner_module.group_for_devices = real_grouping
    return out


# Prompt lookup at tp 2 (`speculation_tp`): two rows speculating at once, k drafts each.
SPEC_ROWS, K = 2, 3
SPEC_SEED, SPEC_TOKENS = 5, 32  # the prompts' phrases, the tokens each reply takes
MIXING = 0.01  # the layers' share of the residual stream (`_weakly_mixing`)
SPEC_GEOMETRY = dict(max_chunk_tokens=16)  # fewer chunk buckets: the warm-up is this case's cost


def spec_jobs(vocab_size, replies=None):
    """Greedy jobs (logprobs on) of repetitive prompts: a random phrase repeated, and with the
    one-device `replies` (a Run) to those, phrase + reply + phrase, so that prompt lookup
    drafts what the reply did after the phrase, and the weakly mixing model (`_weakly_mixing`)
    keeps much of it."""
    from ferrox_jax.request import Job, RowSampling

    rng = np.random.RandomState(SPEC_SEED)
    prompts = [rng.randint(3, vocab_size, 5).tolist() * 4, rng.randint(3, vocab_size, 7).tolist() * 3]
    if replies is not None:
        prompts = [p + replies.tokens[f"s{i}"][0] + p for i, p in enumerate(prompts)]
    return [Job(request_id=f"s{i}", prompt_token_ids=tuple(p), max_tokens=SPEC_TOKENS,
                sampling=RowSampling(temperature=0.0, logprobs=1)) for i, p in enumerate(prompts)]


def _weakly_mixing(model, scale=MIXING):
    """`model` with every layer's output projection (DeltaNet out_proj, o_proj, down_proj)
    scaled by `scale`: the next token then depends mostly on the current one, so a reply
    repeats what followed a token before and lookup's drafts are often right; the layers
    (the DeltaNet states among them) still move the logits by about `scale` of their size,
    which the control's wrong states show."""
    for layer in model.layers:
        for name in ("out_proj", "o_proj", "down_proj"):
            if hasattr(layer, name):
                var = getattr(layer, name)
                var.set_value(var.get_value() * scale)
    return model


def compare(run, ref) -> dict:
    """Whether two runs' replies are the same tokens, and their chosen tokens' max |Δlogprob|
    (over each reply's common length, so a reply cut short by a different token still compares)."""
    err = 0.0
    for key, rows in ref.logprobs.items():
        a, b = run.logprobs[key][0], rows[0]
        n = min(len(a), len(b))
        err = max(err, float(np.abs(np.asarray(a[:n]) - np.asarray(b[:n])).max()) if n else 0.0)
    return {"same_tokens": run.tokens == ref.tokens, "logprob_err": err}


def _no_rollback(part, length, last):
    """The control's `commit_entries`: the run's last token writes entry 0, which follows the
    run's last position, so the next step starts after all 1 + d tokens, rejected or not."""
    return length - 1 - part, last - part + length - 1


def speculation_tp(path, plain_tp):
    """`--speculative ngram` at tp 2 against one device without speculation (one state entry a
    slot), on the checkpoint at `path` made weakly mixing (`_weakly_mixing`): the replies,
    their logprobs, the spec counters, where the pool's entries and positions landed, 0
    recompiles after warm-up, and the compiled decode step's collectives against those of
    `plain_tp` (tp 2 without speculation) at the same shape. The control keeps the states
    after every verified token (the wrong entry on the mesh)."""
    import jax

    from ferrox_jax.config import SpeculativeConfig
    from ferrox_jax.sharding import describe_sharding
    from ferrox_jax.state_pool import state_entries
    from models import deltanet
    from tests.support.sharding_probe import _runner
    from tests.support.spec_driver import drive

    from models.loader import load_checkpoint

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, ngram_min=1, ngram_max=3, max_rows=SPEC_ROWS)
    rows = spec.step_rows(SPEC_ROWS)
    ckpt = load_checkpoint(path)
    _weakly_mixing(ckpt.model)
    one_device = _runner(ckpt.model, 1, **SPEC_GEOMETRY)
    phrases = drive(one_device, ckpt.tokenizer, spec_jobs(ckpt.config.vocab_size), None, max_rows=SPEC_ROWS,
                    state_slots=SPEC_ROWS + 1)
    jobs = spec_jobs(ckpt.config.vocab_size, phrases)
    ref = drive(one_device, ckpt.tokenizer, jobs, None, max_rows=SPEC_ROWS, state_slots=SPEC_ROWS + 1)

    def speculating():
        return _runner(ckpt.model, 2, max_rows=rows, state_entries=state_entries(spec), **SPEC_GEOMETRY)

    runner = speculating()
    runner.warmup()
    run = drive(runner, ckpt.tokenizer, jobs, spec, max_rows=SPEC_ROWS, state_slots=rows + 1)
    counters = run.scheduler.speculator.counters
    states = runner.kv_cache.states
    out = {**compare(run, ref), "drafted": counters.num_draft_tokens, "accepted": counters.num_accepted_tokens,
           "steps": run.num_steps, "steps_off": ref.num_steps, "step_rows": rows, "entries": states.entries,
           "recompiles_after_warmup": runner.recompiles_after_warmup,
           "positions": describe_sharding(states.positions), "conv_pool": describe_sharding(states.conv[0]),
           "recurrent_pool": describe_sharding(states.recurrent[0]),
           "collectives": collectives(runner, 4), "plain_collectives": collectives(plain_tp, 4)}
    real = deltanet.commit_entries
    jax.clear_caches()  # the steps are traced again with the control's commit
    deltanet.commit_entries = _no_rollback
    try:
        bad = drive(speculating(), ckpt.tokenizer, jobs, spec, max_rows=SPEC_ROWS, state_slots=rows + 1)
    finally:
        deltanet.commit_entries = real
        jax.clear_caches()
    out["no_rollback"] = compare(bad, ref)
    return out
