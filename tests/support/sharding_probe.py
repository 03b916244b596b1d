"""Multi-device checks, run by tests/system/test_sharding.py in a subprocess.

The pytest process stays single-device; this script sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax is imported (the test
also passes it in the environment) so the CPU backend shows 8 devices. Each case
prints one JSON object on the last stdout line with what it measured; the test asserts.

    python tests/support/sharding_probe.py tiny      # tiny Llama, 8 heads / 8 KV heads, tp 1/2/4/8
    python tests/support/sharding_probe.py default   # SmolLM2-135M, replicate_attention, tp 2/4/8
    python tests/support/sharding_probe.py server    # HTTP end to end, tensor_parallel=2 vs 1
    python tests/support/sharding_probe.py families DIR...   # HF checkpoints of other families, tp 4 vs 1
    python tests/support/sharding_probe.py families DIR... --tp2-ep DIR...   # and each of these at tp 2, experts
                                                         # split by width and by expert (--expert-parallel)
    python tests/support/sharding_probe.py families DIR... --tp2-state DIR...   # and these Gated DeltaNet
                                                         # checkpoints at tp 2 (tests/support/deltanet_tp_probe.py)
    python tests/support/sharding_probe.py families --tp2-mtp QWEN DEEPSEEK  # --speculative mtp at tp 2 on
                                                         # both (tests/support/mtp_tp_probe.py; last if with others)
    python tests/support/sharding_probe.py family_tp TP DIR  # one HF checkpoint, tp TP vs 1, every placement
    python tests/support/sharding_probe.py collectives DIR   # families, plus its tp 4 decode step's collectives
                                                         # (and a latent-attention model's expanded prefill)
    python tests/support/sharding_probe.py quant     # int8 / w8a8 weights and a bf16 KV cache, tp 2/4
    python tests/support/sharding_probe.py multihost COORD NPROC PID   # one process of a CPU cluster
"""

from __future__ import annotations

import os
import sys

# Only when run as the probe: test files import `mixed_workload` from here, and their
# subprocesses must not inherit 8 devices from the import.
if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from ferrox_jax.step_output import run_plan  # noqa: E402

SEED = 0
BLOCK_SIZE = 8
NUM_BLOCKS = 64
TP_SIZES = (2, 4, 8)


def tiny_config(num_heads=8, num_kv_heads=8):
    """hidden 64 = 8 heads x head_dim 8; F 128 and V 256 divide 8 too."""
    from models.config import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64 // num_heads,
                       max_position_embeddings=512)


def tiny_model(cfg, decode_attention=None, quantization="none"):
    """Random float32 weights (fixed seed) placed through the real build_model checks
    (quantized there when `quantization` is not "none")."""
    from models.loaders.common import build_model, expected_params

    rng = np.random.RandomState(SEED)
    tensors = {}
    for name, shape in expected_params(cfg).items():
        is_norm = name.endswith("norm")
        tensors[name] = (1.0 + 0.1 * rng.randn(*shape) if is_norm else 0.08 * rng.randn(*shape)).astype(np.float32)
    return build_model(cfg, tensors, decode_attention=decode_attention, quantization=quantization)


def _mesh(tp):
    from ferrox_jax.sharding import make_mesh

    return None if tp == 1 else make_mesh(1, tp)


def prefill_then_decode_logits(runner, prompt, num_decode, blocks):
    """Logits of a prefill (f32[len(prompt), V]) and of greedy decode steps (f32[num_decode, V])."""
    from ferrox_jax.plan import RowPlan

    prefill = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks,
                                         sample=False)])[0]
    tokens, decode = list(prompt), []
    last = prefill[-1]
    for _ in range(num_decode):
        tokens.append(int(last.argmax()))
        last = runner.run_logits([RowPlan(row_id=0, token_ids=(tokens[-1],), start_pos=len(tokens) - 1,
                                          block_ids=blocks, sample=False)])[0][-1]
        decode.append(last)
    return prefill, np.stack(decode)


def _runner(model, tp, replicate_attention=False, **kw):
    from ferrox_jax.runner import ModelRunner

    args = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_rows=4, max_chunk_tokens=32, max_context=128)
    args.update(kw)
    return ModelRunner(model, mesh=_mesh(tp), replicate_attention=replicate_attention, **args)


def pallas_interpret_model(cfg, tp):
    """The tiny model decoding through the Pallas TPU kernel (interpret mode) on a tp mesh."""
    from ferrox_jax.runner import block_table_width
    from models.pallas_attention import select_decode_attention

    kernel, _ = select_decode_attention("pallas-interpret", head_dim=cfg.head_dim, block_size=BLOCK_SIZE,
                                        max_blocks_per_row=block_table_width(128, BLOCK_SIZE), mesh=_mesh(tp),
                                        kv_sharded=True)
    return tiny_model(cfg, decode_attention=kernel)


def ragged_interpret_model(cfg, tp, impl, kv_sharded=True):
    """The tiny model attending through a ragged kernel (interpret mode) on a tp mesh."""
    from models.pallas_attention import select_decode_attention

    kernel, _ = select_decode_attention(impl, head_dim=cfg.head_dim, block_size=BLOCK_SIZE, max_blocks_per_row=16,
                                        mesh=_mesh(tp), kv_sharded=kv_sharded)
    return tiny_model(cfg, decode_attention=kernel)


def ragged_sinks_error(tp):
    """Max |delta| of the GPU ragged kernel (interpret mode) with attention sinks on a tp
    mesh (KV heads split, each device its heads' sinks) against one device."""
    import jax
    import jax.numpy as jnp

    from models.layers import Segment
    from models.ragged_attention import ragged_spans
    from models.ragged_gpu import GpuRaggedAttention

    rng = np.random.RandomState(5)
    heads, kv, hd, rows = 8, 4, 16, 3
    k, v = (jnp.asarray(rng.randn(kv, NUM_BLOCKS, BLOCK_SIZE, hd), jnp.float32) for _ in range(2))
    tables = jnp.asarray(rng.permutation(np.arange(1, NUM_BLOCKS))[:rows * 2].reshape(rows, 2), jnp.int32)
    positions = jnp.asarray([[3], [9], [15]], jnp.int32)
    spans = ragged_spans((Segment(0, rows, 1, positions, jnp.ones((rows, 1), bool), tables),))
    q = jnp.asarray(rng.randn(rows, heads, hd), jnp.float32)
    sinks = jnp.asarray(rng.randn(heads), jnp.float32)
    one = GpuRaggedAttention(interpret=True)(q, k, v, spans, scale=0.25, sinks=sinks)
    split = jax.jit(lambda *a: GpuRaggedAttention(mesh=_mesh(tp), kv_sharded=True, interpret=True)(
        *a, scale=0.25, sinks=sinks))(q, k, v, spans)
    return float(jnp.abs(one - split).max())


def parity(model, prompt, num_decode, sizes, replicate_attention=False, sharded_model=None):
    """{tp: {"prefill_err", "decode_err"}} against the unsharded runner; `sharded_model(tp)`
    builds the model the tp runner serves (default: `model` itself)."""
    blocks = tuple(np.random.RandomState(1).permutation(np.arange(1, NUM_BLOCKS))[:8].tolist())
    ref = prefill_then_decode_logits(_runner(model, 1), prompt, num_decode, blocks)
    out = {}
    for tp in sizes:
        served = model if sharded_model is None else sharded_model(tp)
        got = prefill_then_decode_logits(_runner(served, tp, replicate_attention), prompt, num_decode, blocks)
        out[tp] = {"prefill_err": float(np.abs(got[0] - ref[0]).max()),
                   "decode_err": float(np.abs(got[1] - ref[1]).max()),
                   "same_greedy": bool((got[1].argmax(-1) == ref[1].argmax(-1)).all())}
    return out


def placement(runner):
    """Shard shapes of a few weights and the KV cache, as the test inspects them."""
    from ferrox_jax.sharding import describe_sharding

    state = runner.state
    layer = state["layers"][0]
    return {
        "q_proj": describe_sharding(layer["q_proj"][...]),
        "o_proj": describe_sharding(layer["o_proj"][...]),
        "down_proj": describe_sharding(layer["down_proj"][...]),
        "embed": describe_sharding(state["embed"][...]),
        "input_norm": describe_sharding(layer["input_norm"][...]),
        "kv_k0": describe_sharding(runner.kv_cache.k[0]),
    }


def mixed_workload(runner):
    """Prefills of several lengths, decode batches of 1..4 rows, and block copies."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling

    greedy, sampled = RowSampling(temperature=0.0), RowSampling(temperature=0.8, top_p=0.9, seed=3)
    rng = np.random.RandomState(2)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS)).tolist()
    rows = {}
    for i, n in enumerate((1, 7, 8, 9, 31)):
        blocks = tuple(ids[i * 8:(i + 1) * 8])
        prompt = tuple(rng.randint(3, 250, n).tolist())
        res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=i, token_ids=prompt, start_pos=0, block_ids=blocks,
                                                   sample=True, sampling=greedy if i % 2 else sampled),)))
        rows[i] = (blocks, n, res.results[i].token_id)
    for num_rows in (1, 3, 4, 2):
        plan_rows = []
        for i in list(rows)[:num_rows]:
            blocks, n, tok = rows[i]
            plan_rows.append(RowPlan(row_id=i, token_ids=(tok,), start_pos=n, block_ids=blocks, sample=True,
                                     sampling=greedy))
        res = run_plan(runner, StepPlan(decode=tuple(plan_rows), block_copies=((ids[60], ids[61]),)))
        for r in plan_rows:
            blocks, n, _ = rows[r.row_id]
            rows[r.row_id] = (blocks, n + 1, res.results[r.row_id].token_id)


def case_tiny():
    import jax

    t0 = time.perf_counter()
    model = tiny_model(tiny_config())
    prompt = np.random.RandomState(3).randint(3, 250, 19).tolist()  # 19 = 2 blocks of 8 + 3
    out = {"num_devices": len(jax.devices()), "parity": parity(model, prompt, 4, (1,) + TP_SIZES)}
    # The Pallas TPU kernel (interpret mode) inside shard_map over 2 devices.
    out["pallas_parity"] = parity(model, prompt, 2, (2,),
                                  sharded_model=lambda tp: pallas_interpret_model(tiny_config(), tp))
    # The ragged kernels (interpret mode) inside shard_map over 2 devices: KV heads split,
    # and (the GPU one) replicated.
    out["ragged_parity"] = {impl: parity(model, prompt, 2, (2,), sharded_model=lambda tp, impl=impl:
                                         ragged_interpret_model(tiny_config(), tp, impl))
                            for impl in ("ragged-tpu-interpret", "ragged-gpu-interpret")}
    out["ragged_sinks_err"] = ragged_sinks_error(2)
    out["ragged_replicated_parity"] = parity(
        model, prompt, 2, (2,), replicate_attention=True,
        sharded_model=lambda tp: ragged_interpret_model(tiny_config(), tp, "ragged-gpu-interpret", kv_sharded=False))
    runner = _runner(model, 4)
    out["placement_tp4"] = placement(runner)
    runner.warmup()
    mixed_workload(runner)
    out["recompiles_after_warmup_tp4"] = runner.recompiles_after_warmup
    out["kv_after_workload_tp4"] = placement(runner)["kv_k0"]
    out["seconds"] = time.perf_counter() - t0
    return out


def case_default():
    import jax.numpy as jnp

    from models.loader import load_checkpoint

    t0 = time.perf_counter()
    ckpt = load_checkpoint("default", jnp.float32)
    prompt = ckpt.tokenizer.encode("The capital of France is")
    out = {"parity": parity(ckpt.model, prompt, 3, TP_SIZES, replicate_attention=True)}
    runner = _runner(ckpt.model, 8, replicate_attention=True)
    out["placement_tp8"] = placement(runner)
    out["config"] = {"num_heads": ckpt.config.num_heads, "num_kv_heads": ckpt.config.num_kv_heads}
    out["seconds"] = time.perf_counter() - t0
    return out


def case_quant():
    """Each quantized mode on 2 and 4 devices against the same mode on one device, a bfloat16
    KV cache sharded, where the int8 values and their scales live, and zero recompiles."""
    import jax.numpy as jnp

    from ferrox_jax.sharding import describe_sharding

    t0 = time.perf_counter()
    prompt = np.random.RandomState(3).randint(3, 250, 19).tolist()
    out = {"num_devices": len(__import__("jax").devices()), "parity": {}}
    for mode in ("int8", "w8a8"):
        out["parity"][mode] = parity(tiny_model(tiny_config(), quantization=mode), prompt, 3, (2, 4))
    model = tiny_model(tiny_config(), quantization="w8a8")
    runner = _runner(model, 4, kv_dtype=jnp.bfloat16)
    layer = runner.state["layers"][0]
    out["placement_tp4"] = {
        name: {"values": describe_sharding(w.get_value().values), "scales": describe_sharding(w.get_value().scales)}
        for name, w in (("q_proj", layer["q_proj"]), ("o_proj", layer["o_proj"]), ("embed", runner.state["embed"]))}
    out["placement_tp4"]["kv_k0"] = describe_sharding(runner.kv_cache.k[0])
    out["kv_dtype"] = str(jnp.dtype(runner.kv_dtype))
    out["kv_storage_dtype"] = str(runner.kv_cache.k[0].dtype)
    runner.warmup()
    mixed_workload(runner)
    out["recompiles_after_warmup_tp4"] = runner.recompiles_after_warmup
    out["seconds"] = time.perf_counter() - t0
    return out


def case_server():
    """Two engines (1 device, tensor_parallel=2) behind real servers; same greedy text."""
    import httpx

    from api.app import create_app
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tests.support.server_harness import ServerThread, api_checkpoint

    t0 = time.perf_counter()
    ckpt = api_checkpoint()
    answers = {}
    for tp in (1, 2):
        engine = Engine.load(EngineConfig(model=str(ckpt), dtype="float32", block_size=16, kv_blocks=128,
                                          max_context=256, max_seqs=4, max_queue=8, prefill_chunk=32,
                                          tensor_parallel=tp))
        engine.warmup()
        engine.start()
        try:
            with ServerThread(create_app(engine)) as base:
                comp = httpx.post(base + "/v1/completions", timeout=60, json={
                    "model": engine.model_name, "prompt": "The quick brown fox", "max_tokens": 12,
                    "temperature": 0})
                chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
                    "model": engine.model_name, "messages": [{"role": "user", "content": "Hello world!"}],
                    "max_tokens": 12, "temperature": 0})
                stats = engine.stats()
            answers[tp] = {"completion_status": comp.status_code, "chat_status": chat.status_code,
                           "completion": comp.json()["choices"][0]["text"],
                           "chat": chat.json()["choices"][0]["message"]["content"],
                           "devices": engine.describe().get("mesh"),
                           "recompiles": stats.recompiles_after_warmup,
                           "kv_shard_shapes": sorted({tuple(s.data.shape) for s in
                                                      engine.runner.kv_cache.k[0].addressable_shards}),
                           "stats_ok": stats is not None}
        finally:
            engine.shutdown()
    return {"answers": answers, "seconds": time.perf_counter() - t0}


def case_families(*paths):
    """Each checkpoint folder at tp=4 against one device, and where its weights landed."""
    from ferrox_jax.sharding import describe_sharding
    from models.loader import load_checkpoint

    t0 = time.perf_counter()
    out = {}
    for path in paths:
        ckpt = load_checkpoint(path)
        prompt = np.random.RandomState(3).randint(3, ckpt.config.vocab_size, 19).tolist()
        runner = _runner(ckpt.model, 4)
        layers = runner.state["layers"]
        placed = {f"layers.{i}.{name}": describe_sharding(layers[i][name][...])
                  for i in range(ckpt.config.num_layers) for name in
                  ("q_proj", "q_norm", "down_proj", "router", "experts_gate", "experts_up", "experts_down",
                   "q_b_proj", "kv_b_proj", "kv_a_proj")
                  if name in layers[i]}
        placed["kv_k0"] = describe_sharding(runner.kv_cache.k[0])
        out[ckpt.config.architecture] = {"parity": parity(ckpt.model, prompt, 4, (4,))[4], "placement": placed}
        if "experts_gate" in layers[0]:  # a MoE: its quantized expert stacks split the same way
            quantized = load_checkpoint(path, quantization="w8a8").model
            stacks = _runner(quantized, 4).state["layers"][0]
            out[ckpt.config.architecture]["w8a8"] = {
                "parity": parity(quantized, prompt, 4, (4,))[4],
                "placement": {name: {"values": describe_sharding(stacks[name].get_value().values),
                                     "scales": describe_sharding(stacks[name].get_value().scales)}
                              for name in ("experts_gate", "experts_down")}}
    out["seconds"] = time.perf_counter() - t0
    return out


def case_tp2_expert_split(path):
    """One MoE checkpoint at tp 2 against one device, its experts split by width (tensor
    parallelism alone) and by expert (`enable_expert_parallel`, as `--expert-parallel on`
    wires it), where layer 1's weights landed each way; and a negative control: by expert
    with every stack rolled one device along E (each device holds its neighbour's experts)."""
    import jax.numpy as jnp

    from ferrox_jax.sharding import describe_sharding
    from models.loader import load_checkpoint
    from models.moe_ep import enable_expert_parallel

    def split_by_expert(roll=0):
        model = load_checkpoint(path).model
        assert enable_expert_parallel(model, _mesh(2)) > 0
        for layer in model.layers:
            for name in ("experts_gate", "experts_up", "experts_down"):
                if roll and hasattr(layer, name):
                    getattr(layer, name).set_value(jnp.roll(getattr(layer, name).get_value(), roll, axis=0))
        return model

    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    prompt = np.random.RandomState(3).randint(3, cfg.vocab_size, 19).tolist()
    names = ("q_proj", "q_bias", "k_bias", "q_norm", "o_proj", "router", "experts_gate", "experts_down",
             "down_proj")
    out = {}
    for mode, build in (("by_width", lambda: ckpt.model), ("by_expert", split_by_expert),
                        ("by_expert_rolled", lambda: split_by_expert(cfg.num_experts // 2))):
        model = build()
        out[mode] = {"parity": parity(ckpt.model, prompt, 4, (2,), sharded_model=lambda tp, m=model: m)[2]}
        layer = _runner(model, 2).state["layers"][1]
        out[mode]["placement"] = {name: describe_sharding(layer[name][...]) for name in names if name in layer}
    return out


def case_family_tp(tp, path):
    """One checkpoint folder at tensor parallelism `tp` against one device, and where the
    weights of its first layer landed (every parameter, by name)."""
    from ferrox_jax.sharding import describe_sharding
    from models.loader import load_checkpoint

    ckpt = load_checkpoint(path)
    prompt = np.random.RandomState(3).randint(3, ckpt.config.vocab_size, 19).tolist()
    layer = _runner(ckpt.model, tp).state["layers"][0]
    placed = {name: describe_sharding(layer[name][...]) for name in layer}
    return {"parity": parity(ckpt.model, prompt, 4, (tp,))[tp], "placement": placed}


def case_collectives(path):
    """`families` for one checkpoint, plus the collectives of its compiled tp=4 one-row
    decode step: {op: count} and the all-gathered shapes."""
    import dataclasses
    import re

    from models.loader import load_checkpoint

    out = case_families(path)
    arch = load_checkpoint(path).config.architecture
    runner = _runner(load_checkpoint(path).model, 4)
    text = runner._compile(("forward", 1, 0, 0)).as_text()
    ops = re.findall(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(", text)
    out[arch]["collectives"] = {op: ops.count(op) for op in sorted(set(ops))}
    out[arch]["all_gathered"] = re.findall(r"= (\S+?)\{[^}]*\} all-gather\(", text)
    # latent attention's expanded prefill (every prompt chunk) with the heads split
    model = load_checkpoint(path).model
    if hasattr(model.layers[0], "mla_spec"):
        for layer in model.layers:
            layer.mla_spec = dataclasses.replace(layer.mla_spec, expand_from=2)
        prompt = np.random.RandomState(3).randint(3, model.cfg.vocab_size, 19).tolist()
        out[arch]["expanded_parity"] = parity(model, prompt, 4, (4,))[4]
    return out


def case_multihost(coordinator, num_processes, process_id):
    """One process of a local CPU cluster: initialize, build a global mesh, psum across it."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from ferrox_jax.engine_builder import initialize_distributed

    initialize_distributed(coordinator, int(num_processes), int(process_id))
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ferrox_jax.sharding import make_mesh

    mesh = make_mesh(1, len(jax.devices()))
    sharding = NamedSharding(mesh, P(None, "model"))
    local = np.arange(4 * len(jax.devices()), dtype=np.float32).reshape(4, -1)
    x = jax.make_array_from_callback(local.shape, sharding, lambda idx: local[idx])
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    out = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "num_global_devices": len(jax.devices()), "num_local_devices": len(jax.local_devices()),
           "sum": float(total), "expected_sum": float(local.sum())}
    # The runner's sharded steps on a mesh spanning both processes; every process feeds the
    # same rows (multi-controller JAX), as a plan-broadcasting follower loop would.
    model = tiny_model(tiny_config())
    prompt = np.random.RandomState(3).randint(3, 250, 19).tolist()
    blocks = tuple(np.random.RandomState(1).permutation(np.arange(1, NUM_BLOCKS))[:8].tolist())
    runner = _runner(model, len(jax.devices()))
    prefill, decode = prefill_then_decode_logits(runner, prompt, 2, blocks)
    ref_prefill, ref_decode = prefill_then_decode_logits(_runner(model, 1), prompt, 2, blocks)  # local device
    out["kv_local_shard_shapes"] = sorted({tuple(s.data.shape) for s in runner.kv_cache.k[0].addressable_shards})
    out["prefill_err"] = float(np.abs(prefill - ref_prefill).max())
    out["decode_err"] = float(np.abs(decode - ref_decode).max())
    return out


def main(argv):
    case = argv[1]
    if case == "multihost":
        result = case_multihost(*argv[2:5])
    elif case == "families":
        mtp = argv.index("--tp2-mtp") if "--tp2-mtp" in argv else len(argv)
        argv, mtp_paths = argv[:mtp], argv[mtp + 1:]
        state = argv.index("--tp2-state") if "--tp2-state" in argv else len(argv)
        split = argv.index("--tp2-ep") if "--tp2-ep" in argv[:state] else state
        result = case_families(*argv[2:split])
        for path in argv[split + 1:state]:
            result[f"tp2:{path}"] = case_tp2_expert_split(path)
        for i, path in enumerate(argv[state + 1:]):  # the recurrent-state families (the first: its control too)
            from tests.support.deltanet_tp_probe import case_state_tp

            result[f"state:{path}"] = case_state_tp(path, control=i == 0)
        if mtp_paths:  # a Qwen3.5 and a DeepSeek-V3 with their MTP blocks (tests/support/mtp_tp_probe.py)
            from tests.support.mtp_tp_probe import case_mtp

            result["mtp"] = case_mtp(*mtp_paths)
    elif case == "family_tp":
        result = case_family_tp(int(argv[2]), argv[3])
    elif case == "collectives":
        result = case_collectives(argv[2])
    else:
        result = {"tiny": case_tiny, "default": case_default, "server": case_server, "quant": case_quant}[case]()
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv)
