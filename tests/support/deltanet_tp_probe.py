"""Tensor parallelism for the Gated DeltaNet families (Qwen3.5, Qwen3-Next), run inside the
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


def collectives(runner):
    """[(op, result shape)] of the compiled one-row decode step, as the HLO text lists them."""
    text = runner._executable(("forward", 1, 0, 0)).as_text()
    found = re.findall(r"= (\S+?)\{[^}]*\} (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(",
                       text)
    return [(op, shape) for shape, op in found]


def case_state_tp(path, control=False):
    """One checkpoint at tp 2 against one device (module docstring)."""
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
                                    "in_proj_ba", "conv_weight", "A_log", "dt_bias", "gate_norm", "out_proj")}
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
