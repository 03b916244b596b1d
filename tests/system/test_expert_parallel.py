"""Expert parallelism (`--expert-parallel`, models/moe_ep.py) on 2 and 4 simulated CPU devices:
tiny Mixtral-, Qwen3-MoE-, DeepSeek-V3- and gpt-oss-shaped checkpoints (8 experts each, so
4 or 2 whole experts per device) against one device, in one subprocess
(tests/support/expert_parallel_probe.py; the pytest process stays single-device).

Negative controls: the same probe with each device holding its neighbour's experts, and
with each device's first expert counted one too far, must miss one device by far more
than the tolerance. The rules (specs, the divisibility refusal) need no devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers
from jax.sharding import PartitionSpec as P

from ferrox_jax.sharding import check_divisibility, param_partition_spec
from tests.models.test_family_deepseek_v3 import SHAPE as DSV3_SHAPE
from tests.models.test_family_gpt_oss import make_gpt_oss
from tests.support import family_checks as fc
from tests.system.test_sharding import ATOL, ROOT
from tests.support.xla_flags import with_devices

PROBE = ROOT / "tests" / "support" / "expert_parallel_probe.py"
WRONG = 100 * ATOL  # a negative control must miss one device by at least this
E = 8
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
              tie_word_embeddings=False)


def _probe(*args: str, timeout_s: int = 600) -> dict:
    env = {**os.environ, "XLA_FLAGS": with_devices(4)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    proc = subprocess.run([sys.executable, str(PROBE), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"probe {args} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    mixtral = fc.make_checkpoint(root / "mixtral", transformers.MixtralConfig(
        intermediate_size=32, num_hidden_layers=2, num_local_experts=E, num_experts_per_tok=2, **COMMON))
    qwen3 = fc.make_checkpoint(root / "qwen3moe", transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2, head_dim=16, num_experts=E,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], **COMMON))
    dsv3 = fc.make_checkpoint(root / "dsv3", transformers.DeepseekV3Config(
        **DSV3_SHAPE, n_routed_experts=E, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256, tie_word_embeddings=False))
    gpt_oss, _ = make_gpt_oss(root / "gptoss", num_local_experts=E, num_key_value_heads=4)
    return {"MixtralForCausalLM": mixtral, "Qwen3MoeForCausalLM": qwen3, "DeepseekV3ForCausalLM": dsv3,
            "GptOssForCausalLM": gpt_oss}


@pytest.fixture(scope="module")
def probed(checkpoints):
    return _probe("all", str(checkpoints["Qwen3MoeForCausalLM"]), *map(str, checkpoints.values()))


ARCHS = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("devices", [2, 4])
def test_expert_parallel_matches_one_device(probed, arch, devices):
    got = probed["parity"][arch][f"ep{devices}"]
    assert got["prefill_err"] < ATOL, f"{arch} EP {devices}: prefill logits differ by {got['prefill_err']}"
    assert got["decode_err"] < ATOL, f"{arch} EP {devices}: decode logits differ by {got['decode_err']}"
    assert got["same_greedy"], f"{arch} EP {devices}: greedy tokens changed"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("devices", [2, 4])
def test_each_device_holds_whole_experts(probed, arch, devices):
    place = probed["parity"][arch][f"ep{devices}"]["placement"]
    gate = place["experts_gate"]["shard_shapes"]
    assert len(gate) == 1 and gate[0][0] == E // devices, f"{arch}: {E} experts over {devices} devices: {gate}"
    down = place["experts_down"]["shard_shapes"][0]
    assert down[0] == E // devices and down[2] == 64, f"{arch}: experts_down keeps its full width: {down}"
    assert place["router"]["shard_shapes"] == [[64, E]], f"{arch}: the router is replicated"
    for bias in ("experts_gate_bias", "experts_down_bias"):
        if bias in place:  # gpt-oss
            assert place[bias]["shard_shapes"][0][0] == E // devices, f"{arch}: {bias} splits with its experts"


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_quantized_expert_stacks_split_by_expert(probed, arch):
    """w8a8 at EP 4 against w8a8 on one device; int8 values and their [E, F] scales split by expert."""
    got = probed["parity"][arch]["ep4_w8a8"]
    assert got["prefill_err"] < ATOL and got["decode_err"] < ATOL and got["same_greedy"], got
    assert got["placement"]["values"]["shard_shapes"][0][0] == E // 4
    assert got["placement"]["scales"]["shard_shapes"][0][0] == E // 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("control", ["experts_on_the_wrong_device", "offset_off_by_one"])
def test_misplaced_experts_are_caught(probed, arch, control):
    got = probed["parity"][arch][control]
    assert max(got["prefill_err"], got["decode_err"]) > WRONG, f"{arch} {control} went unnoticed: {got}"


def test_no_recompiles_after_warmup_and_one_all_reduce_per_expert_layer(probed):
    """Qwen3-MoE (layer 0 experts, layer 1 dense) at EP 4: a mixed workload after warm-up compiles
    nothing. Its one-row decode step gathers only the vocab-split logits (no expert weight) and
    sums the expert layer once, [1 row, D 64]; split by width instead (the control), the same
    step all-reduces each tile of 8 rows inside the tile loop, [8, 64], and that one [1, 64] less."""
    got = probed["warm"]
    assert got["recompiles_after_warmup"] == 0, got
    ep, tp = got["ep"], got["tp"]
    assert ep["all_gathered"] == ["f32[1,384]"], f"something besides the logits is gathered: {ep}"
    assert "f32[8,64]" not in ep["all_reduced"], f"expert parallelism all-reduces per tile: {ep}"
    assert tp["all_reduced"].get("f32[8,64]") == 1, f"the width split's per-tile all-reduce is gone: {tp}"
    assert ep["all_reduced"]["f32[1,64]"] == tp["all_reduced"]["f32[1,64]"] + 1, (ep, tp)


def test_the_engine_build_serves_each_mode(probed):
    """`build_parts` at tp 4 (Qwen3-MoE, 8 experts of width 16): "on" splits by expert (2 each) and
    matches one device; "auto" (8 < 32 experts) and "off" split each expert's width (16 / 4 = 4);
    8 experts on 3 devices are refused, naming the numbers and the way out."""
    got = probed["build"]
    assert got["on"]["served"] == "on" and got["on"]["experts_gate"] == [2, 64, 16], got["on"]
    assert got["on"]["prefill_err"] < ATOL and got["on"]["decode_err"] < ATOL and got["on"]["same_greedy"]
    for mode in ("auto", "off"):
        assert got[mode] == {"served": "off", "experts_gate": [8, 64, 4]}, (mode, got[mode])
    assert got["refused"] and "3 devices do not divide the model's num_experts 8" in got["refused"]
    assert "--expert-parallel off" in got["refused"] and "Error" not in got["refused"]


# ---- rules (no devices needed) --------------------------------------------------------

@pytest.mark.parametrize("experts, devices, mode, split", [
    (128, 8, "auto", True),  # Qwen3-MoE: 16 experts per device
    (32, 8, "auto", True),  # AUTO_MIN_EXPERTS: 4 per device
    (16, 8, "auto", False),  # below it: each expert split by width
    (8, 4, "auto", False),  # Mixtral-sized
    (128, 3, "auto", False),  # 3 does not divide 128: auto falls back, it does not refuse
    (128, 1, "auto", False),  # one device: nothing to split
    (8, 4, "on", True),
    (128, 8, "off", False),
])
def test_auto_splits_by_expert_from_32_experts_the_devices_divide(experts, devices, mode, split):
    from models.moe_ep import resolve_expert_parallel

    got, note = resolve_expert_parallel(mode, _moe_config(experts), devices)
    assert got is split, note


def test_auto_leaves_other_families_and_dense_models_alone():
    import dataclasses

    from models.config import ModelConfig
    from models.moe_ep import resolve_expert_parallel

    gemma4 = dataclasses.replace(_moe_config(128), architecture="Gemma4ForCausalLM")
    assert resolve_expert_parallel("auto", gemma4, 8)[0] is False
    dense = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=4, head_dim=16, max_position_embeddings=512)
    assert resolve_expert_parallel("auto", dense, 8) == (False, "")
    with pytest.raises(ValueError, match="not supported for Gemma4ForCausalLM"):
        resolve_expert_parallel("on", gemma4, 8)


def test_engine_config_names_the_field_for_an_unknown_mode():
    from ferrox_jax.config import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.expert_parallel must be one of auto, on, off"):
        EngineConfig(model="m", expert_parallel="yes")


def _moe_config(num_experts=E):
    from models.moe import MoeConfig

    return MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=4,
                     head_dim=16, max_position_embeddings=512, architecture="Qwen3MoeForCausalLM",
                     num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=30)


def test_specs_split_stacks_by_expert_only_under_expert_parallel():
    cfg = _moe_config()
    spec = lambda name, shape, ep: param_partition_spec(name, shape, cfg, expert_parallel=ep)  # noqa: E731
    assert spec("layers.0.experts_gate", (E, 64, 30), True) == P("model", None, None)
    assert spec("layers.0.experts_down", (E, 30, 64), True) == P("model", None, None)
    assert spec("layers.0.experts_down_bias", (E, 64), True) == P("model", None)
    assert spec("layers.0.router", (64, E), True) == P()
    assert spec("layers.0.q_proj", (64, 64), True) == P(None, "model"), "attention is still tensor parallel"
    # the control: without it the experts split by width
    assert spec("layers.0.experts_gate", (E, 64, 30), False) == P(None, None, "model")


def test_divisibility_asks_the_expert_count_not_the_width():
    cfg = _moe_config()  # 8 experts 30 wide: 4 divides 8, not 30
    check_divisibility(cfg, 4, False, expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size 30"):
        check_divisibility(cfg, 4, False)
    with pytest.raises(ValueError, match="--expert-parallel: 3 devices do not divide the model's num_experts 8"):
        check_divisibility(_moe_config(), 3, True, expert_parallel=True)


def test_a_model_without_experts_or_unsupported_is_refused():
    from models.config import ModelConfig

    dense = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=4, head_dim=16, max_position_embeddings=512, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match="has no routed experts"):
        check_divisibility(dense, 2, False, expert_parallel=True)
    import dataclasses

    other = dataclasses.replace(_moe_config(), architecture="Gemma4ForCausalLM")
    with pytest.raises(ValueError, match="not supported for Gemma4ForCausalLM"):
        check_divisibility(other, 2, False, expert_parallel=True)


def test_the_flag_and_its_variable_reach_the_engine_config():
    from api import cli

    def engine_config(argv, environ=None):
        return cli.engine_config(cli.build_parser(environ or {}).parse_args(["serve", *argv]))

    assert engine_config([]).expert_parallel == "auto"
    assert engine_config(["--expert-parallel", "on"]).expert_parallel == "on"
    assert engine_config([], {"FERROX_EXPERT_PARALLEL": "off"}).expert_parallel == "off"
    with pytest.raises(SystemExit, match=r"--expert-parallel \(FERROX_EXPERT_PARALLEL\) must be one of auto, on, off"):
        engine_config(["--expert-parallel", "sometimes"])
