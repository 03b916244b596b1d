"""Expert-parallel checks on 4 simulated CPU devices, run by tests/system/test_expert_parallel.py
in a subprocess (as tests/support/sharding_probe.py is: the pytest process stays single-device).

    python tests/support/expert_parallel_probe.py parity DIR...   # each checkpoint, EP 2 and 4 vs 1 device
    python tests/support/expert_parallel_probe.py warm DIR        # EP 4: recompiles after warm-up, collectives
    python tests/support/expert_parallel_probe.py build DIR       # the engine's build for each --expert-parallel
    python tests/support/expert_parallel_probe.py all DIR DIR...  # build and warm for the first, parity for the rest

Prints one JSON object on the last stdout line; the test asserts.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402

from tests.support.sharding_probe import _mesh, _runner, mixed_workload, prefill_then_decode_logits  # noqa: E402

BLOCKS = tuple(np.random.RandomState(1).permutation(np.arange(1, 64))[:8].tolist())
NUM_DECODE = 3
# w8a8 stacks at EP 4 for these (one plain, one with expert biases): the rule is the same for all.
W8A8_ARCHS = ("Qwen3MoeForCausalLM", "GptOssForCausalLM")


def ep_model(path, tp, quantization="none", kind=None):
    """A fresh model of `path` whose expert layers run split by expert over a tp mesh."""
    from models.loader import load_checkpoint
    from models.moe_ep import ExpertParallel, enable_expert_parallel

    model = load_checkpoint(path, quantization=quantization).model
    assert enable_expert_parallel(model, _mesh(tp), kind or ExpertParallel) > 0
    return model


def off_by_one():
    """ExpertParallel with each device's first expert counted one too far (a distinct class,
    so a distinct static attribute: the step is traced again, not taken from jit's cache)."""
    from models.moe_ep import ExpertParallel

    class OffByOne(ExpertParallel):
        def first_expert(self, device, per_device):
            return device * per_device + 1

    return OffByOne


def errors(got, ref) -> dict:
    return {"prefill_err": float(np.abs(got[0] - ref[0]).max()), "decode_err": float(np.abs(got[1] - ref[1]).max()),
            "same_greedy": bool((got[1].argmax(-1) == ref[1].argmax(-1)).all()
                                and got[0][-1].argmax() == ref[0][-1].argmax())}


def roll_experts(model, by: int):
    """Move every expert stack of `model` `by` experts along E (expert e's weights where
    e + by's were). With `by` = E / M this is each device holding its neighbour's experts
    (a jax.Array's shards are its global value's contiguous slices, so misplacing shards
    and rolling the stack are the same thing) while routing still looks for its own."""
    import jax.numpy as jnp

    for layer in model.layers:
        for name in ("experts_gate", "experts_up", "experts_down", "experts_gate_bias", "experts_up_bias",
                     "experts_down_bias"):
            if hasattr(layer, name):
                getattr(layer, name).set_value(jnp.roll(getattr(layer, name).get_value(), by, axis=0))
    return model


def case_parity(*paths):
    from ferrox_jax.sharding import describe_sharding
    from models.loader import load_checkpoint

    out = {}
    for path in paths:
        ckpt = load_checkpoint(path)
        cfg = ckpt.config
        prompt = np.random.RandomState(3).randint(3, cfg.vocab_size, 11).tolist()
        ref = prefill_then_decode_logits(_runner(ckpt.model, 1), prompt, NUM_DECODE, BLOCKS)
        got = {}
        for tp in (2, 4):
            runner = _runner(ep_model(path, tp), tp)
            got[f"ep{tp}"] = errors(prefill_then_decode_logits(runner, prompt, NUM_DECODE, BLOCKS), ref)
            layer = next(i for i in range(cfg.num_layers) if "experts_gate" in runner.state["layers"][i])
            stacks = runner.state["layers"][layer]
            got[f"ep{tp}"]["placement"] = {name: describe_sharding(stacks[name][...]) for name in stacks
                                            if name.startswith(("experts_", "router"))}
        if cfg.architecture in W8A8_ARCHS:
            quantized = _runner(ep_model(path, 4, "w8a8"), 4)
            quantized_ref = prefill_then_decode_logits(_runner(load_checkpoint(path, quantization="w8a8").model, 1),
                                                       prompt, NUM_DECODE, BLOCKS)
            got["ep4_w8a8"] = errors(prefill_then_decode_logits(quantized, prompt, NUM_DECODE, BLOCKS),
                                     quantized_ref)
            stacks = quantized.state["layers"][layer]["experts_gate"].get_value()
            got["ep4_w8a8"]["placement"] = {"values": describe_sharding(stacks.values),
                                            "scales": describe_sharding(stacks.scales)}
        # Negative controls at EP 4. The devices' experts one off from where routing looks for them:
        wrong_device = _runner(roll_experts(ep_model(path, 4), cfg.num_experts // 4), 4)
        got["experts_on_the_wrong_device"] = errors(
            prefill_then_decode_logits(wrong_device, prompt, NUM_DECODE, BLOCKS), ref)
        # ... and each device's first expert counted one too far (an off-by-one offset).
        got["offset_off_by_one"] = errors(
            prefill_then_decode_logits(_runner(ep_model(path, 4, kind=off_by_one()), 4), prompt, NUM_DECODE, BLOCKS),
            ref)
        out[cfg.architecture] = got
    return out


def collectives(runner) -> dict:
    """{"counts": {op: n}, "all_reduced": {shape: n}, "all_gathered": [shapes]} of the runner's
    compiled one-row decode step (each op once in the HLO text, even inside a loop)."""
    text = runner._compile(("forward", 1, 0, 0)).as_text()
    ops = re.findall(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(", text)
    reduced = re.findall(r"= (\S+?)\{[^}]*\} all-reduce\(", text)
    return {"counts": {op: ops.count(op) for op in sorted(set(ops))},
            "all_reduced": {shape: reduced.count(shape) for shape in sorted(set(reduced))},
            "all_gathered": sorted(set(re.findall(r"= (\S+?)\{[^}]*\} all-gather\(", text)))}


def case_warm(path):
    """EP 4: warm-up compiles every bucket, then a mixed workload must compile nothing; and
    the collectives of its one-row decode step, beside tensor parallelism's (the experts
    split by width) on the same checkpoint."""
    from models.loader import load_checkpoint

    runner = _runner(ep_model(path, 4), 4)
    runner.warmup()
    mixed_workload(runner)
    return {"recompiles_after_warmup": runner.recompiles_after_warmup, "ep": collectives(runner),
            "tp": collectives(_runner(load_checkpoint(path).model, 4))}


def case_build(path):
    """The engine's own wiring (`build_parts`, not warmed up) at tp 4 for each
    `--expert-parallel` mode: what it resolved to, where layer 0's experts landed, and the
    "on" runner's logits against one device; then the refusal of 8 experts on 3 devices."""
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine_builder import build_parts
    from models.loader import load_checkpoint

    def config(**kw):
        return EngineConfig(model=path, dtype="float32", block_size=8, kv_blocks=64, max_context=128, max_seqs=2,
                            max_queue=4, prefill_chunk=32, grammar_sandbox=False, **kw)

    ckpt = load_checkpoint(path)
    prompt = np.random.RandomState(3).randint(3, ckpt.config.vocab_size, 11).tolist()
    ref = prefill_then_decode_logits(_runner(ckpt.model, 1), prompt, NUM_DECODE, BLOCKS)
    out = {}
    for mode in ("on", "auto", "off"):
        parts = build_parts(config(tensor_parallel=4, expert_parallel=mode))
        out[mode] = {"served": parts.config.expert_parallel,
                     "experts_gate": parts.device.state["layers"][0]["experts_gate"][...].sharding.shard_shape(
                         parts.device.state["layers"][0]["experts_gate"][...].shape)}
        if mode == "on":
            out[mode].update(errors(prefill_then_decode_logits(parts.device, prompt, NUM_DECODE, BLOCKS), ref))
    try:
        build_parts(config(tensor_parallel=3, replicate_attention=True, expert_parallel="on"))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def case_all(warm_path, *paths):
    """parity for every path, warm and build for `warm_path`: one process, one jax start."""
    return {"parity": case_parity(*paths), "warm": case_warm(warm_path), "build": case_build(warm_path)}


def main(argv):
    case = argv[1]
    result = {"parity": case_parity, "warm": case_warm, "build": case_build, "all": case_all}[case](*argv[2:])
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
