"""`--speculative mtp` at tp 2 in a second run of the probe (tests/support/mtp_tp_probe.py): that
Qwen3.5 of tests/system/test_family_sharding.py with an `mtp.*` block and a tiny DeepSeek-V3 with its MTP layer (latent attention, MoE),
each against one device without speculation, with the drafts those of the same block on one
device; the layer split as the family's layers are, its compiled steps carrying its own
collectives only; the controls split fc's columns out of order (Qwen) and read the hidden state
from the wrong shard (DeepSeek), and lose the acceptance."""

from __future__ import annotations

import pytest

from tests.support import mtp_tp_probe
from tests.system.test_family_sharding import qwen3_5_checkpoint
from tests.system.test_sharding import _probe


@pytest.fixture(scope="module")
def mtp_probed(tmp_path_factory):
    """The same probe on the MTP checkpoints alone (`--tp2-mtp`): a run of its own, so that
    the families run (tests/system/test_family_sharding.py) and this one each keep to a test's time
    limit on a loaded machine, and CI's two workers can take them in parallel."""
    root = tmp_path_factory.mktemp("tp_mtp")
    qwen = qwen3_5_checkpoint(root)
    mtp_tp_probe.write_qwen_mtp_block(qwen)  # the main model's loader skips mtp.*
    deepseek = mtp_tp_probe.deepseek_mtp_checkpoint(root / "deepseek_v3_mtp")
    return _probe("families", "--tp2-mtp", str(qwen), str(deepseek), timeout_s=600)["mtp"]


MTP_FAMILIES = ["qwen3_5", "deepseek_v3"]
MTP_LOGPROB_ATOL = 5e-5  # the tp 2 target's own: tp 2 without speculation is as far from one device


@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_mtp_tp2_matches_one_device_without_speculation_with_the_same_drafts(mtp_probed, name):
    """`--speculative mtp` (k = 3, two rows) at tp 2: the one-device replies without speculation,
    token for token, logprobs within MTP_LOGPROB_ATOL; the drafts proposed and accepted are
    exactly those of the same block on one device, and they save target steps."""
    got = mtp_probed[name]
    assert got["same_tokens"] and got["one_device_same_tokens"], f"{name}: mtp at tp 2 changed the greedy reply"
    assert got["logprob_err"] < MTP_LOGPROB_ATOL, f"{name}: logprobs moved by {got['logprob_err']}"
    c = got["counters"]
    assert c == got["one_device_counters"], (c, got["one_device_counters"])
    assert 0 < c["accepted"] <= c["drafted"] and c["accepted"] >= c["drafted"] // 4, c
    assert c["steps"] < got["plain_steps"], "accepted drafts save target steps (a count, not a timing)"


def test_mtp_tp2_splits_the_layer_like_the_familys_own(mtp_probed):
    """fc / eh_proj by output column, the heads (q_proj, q_b_proj / kv_b_proj) by column and
    o_proj by row, the MLP and the experts by width, the embedding and head as the target's;
    the one-layer cache split by KV head like the target's (Qwen), or one latent head,
    replicated like the target's (DeepSeek)."""
    qwen, deepseek = (mtp_probed[name]["placement"] for name in MTP_FAMILIES)
    # D 64, V 384 over 2 devices
    assert qwen["fc"]["shard_shapes"] == [[128, 32]] and deepseek["eh_proj"]["shard_shapes"] == [[128, 32]]
    for place in (qwen, deepseek):
        assert place["head"]["shard_shapes"] == [[64, 192]] and place["embed"]["shard_shapes"] == [[192, 64]]
        assert place["enorm"]["shard_shapes"] == [[64]] and place["enorm"]["num_shards"] == 2, "norms replicated"
    assert qwen["layer.q_proj"]["shard_shapes"] == [[64, 128]], "4 gated heads x 32 (query and gate) halved"
    assert qwen["layer.o_proj"]["shard_shapes"] == [[64, 64]] and qwen["layer.down_proj"]["shard_shapes"] == [[64, 64]]
    assert qwen["cache_k"] == qwen["target_kv_k"] and qwen["cache_k"]["shard_shapes"] == [[1, 64, 8, 32]], \
        "2 KV heads, one a device, as the target's full-attention cache"
    assert deepseek["layer.q_b_proj"]["shard_shapes"] == [[24, 48]] and deepseek["layer.kv_a_proj"]["spec"] == "P()"
    assert deepseek["layer.experts_gate"]["shard_shapes"] == [[4, 64, 16]], "4 experts of width 32: 16 columns each"
    assert deepseek["layer.experts_down"]["shard_shapes"] == [[4, 16, 64]]
    assert deepseek["cache_k"] == deepseek["target_kv_k"] and deepseek["cache_k"]["spec"] == "P()", \
        "one latent head, replicated as the target's"


@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_mtp_tp2_steps_carry_only_the_layers_collectives(mtp_probed, name):
    """The compiled one-row steps: `follow` (the layer's K/V only: its attention output and MLP
    are unused there) reduces the vocab-split embedding and gathers fc's columns; `propose`
    adds the row-parallel o_proj and down_proj reductions (DeepSeek: the shared expert's, and
    the experts' one per 8-token tile) and one gather of the vocab-split logits. Nothing is
    permuted or exchanged, and the residual stream is never carried split (no reduction per norm)."""
    from collections import Counter

    got = mtp_probed[name]
    row = f"f32[1,{got['hidden_size']}]"
    follow, propose = (Counter(map(tuple, got["collectives"][step])) for step in ("follow", "propose"))
    assert follow == Counter({("all-reduce", row): 1, ("all-gather", row): 1}), follow
    want = Counter({("all-reduce", row): 3, ("all-gather", row): 1, ("all-gather", f"f32[1,{got['vocab_size']}]"): 1})
    if name == "deepseek_v3":
        want[("all-reduce", f"f32[8,{got['hidden_size']}]")] = 1
    assert propose == want, propose


@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_mtp_tp2_compiles_nothing_after_warmup(mtp_probed, name):
    got = mtp_probed[name]
    assert got["recompiles_after_warmup"] == 0
    warm, after = got["jit_caches"]
    assert warm == after, f"the jitted steps compiled again after the warm-up: {warm} -> {after}"


@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_mtp_tp2_control_wrong_split_keeps_the_reply_and_loses_the_drafts(mtp_probed, name):
    """The checks catch a wrong split on the mesh: Qwen's fc with each device's output columns
    the next device's, DeepSeek's hidden state read from the wrong shard. The reply is still
    the target's (verification is exact); the drafts are no longer accepted."""
    got = mtp_probed[name]
    bad, good = got["control"]["counters"], got["counters"]
    assert got["control"]["same_tokens"]
    assert bad["drafted"] > 0 and bad["accepted"] <= bad["drafted"] // 10 < good["accepted"], (bad, good)
