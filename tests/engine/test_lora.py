"""models/lora.py and ferrox_jax/lora_registry.py without a model: the slot product, PEFT
files and their refusals, and the registry's slot lifecycle (a fake runner whose state is
one LoraWeight)."""

from __future__ import annotations

import collections
import json
import types

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from ferrox_jax.lora_registry import LoraRegistry
from ferrox_jax.runner_protocol import DeviceState
from models.lora import LoraError, LoraSlots, LoraWeight, lora_delta, lora_delta_gather, lora_scale, read_peft_adapter

D_IN, D_OUT = 8, 6
TABLE = {"self_attn.q_proj.weight": "q_proj", "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj")}
TARGETS = {(0, "q_proj"): (D_IN, D_OUT)}


def _weight(slots=3, rank=4, seed=0):
    rng = np.random.RandomState(seed)
    a = rng.randn(slots, D_IN, rank).astype(np.float32)
    b = rng.randn(slots, rank, D_OUT).astype(np.float32)
    a[0], b[0] = 0.0, 0.0  # slot 0: no adapter
    flat_a = a.transpose(1, 0, 2).reshape(D_IN, slots * rank)  # slot s in columns s*r .. s*r + r - 1
    w = LoraWeight(base=jnp.asarray(rng.randn(D_IN, D_OUT), jnp.float32), a=jnp.asarray(flat_a),
                   b=jnp.asarray(b.reshape(slots * rank, D_OUT)), num_slots=slots, rank=rank)
    return w, a, b


def test_slot_zero_adds_exactly_zero_and_slots_match_numpy():
    w, a, b = _weight()
    slots = np.asarray([0, 1, 2, 0, 2], np.int32)
    x = np.random.RandomState(1).randn(len(slots), D_IN).astype(np.float32)
    got = np.asarray(lora_delta(jnp.asarray(x), w.replace(token_slots=jnp.asarray(slots))))
    assert np.all(got[slots == 0] == 0.0), "a token in slot 0 must get exactly 0.0"
    want = np.stack([x[n] @ a[s] @ b[s] for n, s in enumerate(slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # f32, inner sizes 8 and 4
    gathered = np.asarray(lora_delta_gather(jnp.asarray(x), w.replace(token_slots=jnp.asarray(slots))))
    np.testing.assert_allclose(gathered, want, rtol=1e-5, atol=1e-5)


def test_scale_is_alpha_over_r_or_over_sqrt_r_with_rslora():
    assert lora_scale({"r": 4, "lora_alpha": 8}) == (4, 2.0)  # 8 / 4
    assert lora_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}) == (4, 4.0)  # 8 / sqrt(4)


def _adapter(folder, r=4, alpha=8, module="self_attn.q_proj", seed=0, **config):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(seed)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                            **config}))
    out = D_OUT * 3 if "qkv" in module else D_OUT
    prefix = f"base_model.model.model.layers.0.{module}"
    save_file({f"{prefix}.lora_A.weight": rng.randn(r, D_IN).astype(np.float32),
               f"{prefix}.lora_B.weight": rng.randn(out, r).astype(np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def test_peft_layout_is_transposed_with_the_scale_folded_into_b(tmp_path):
    path = _adapter(tmp_path / "a", r=4, alpha=8)
    adapter = read_peft_adapter(path, TABLE, TARGETS, max_rank=8)
    a, b = adapter.weights[(0, "q_proj")]
    from safetensors.numpy import load_file

    raw = load_file(str(path / "adapter_model.safetensors"))
    np.testing.assert_array_equal(a, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].T)
    np.testing.assert_allclose(b, 2.0 * raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].T)


@pytest.mark.parametrize("kwargs, code", [
    (dict(r=16), "rank_too_large"),
    (dict(module="self_attn.o_proj"), "missing_target_module"),
    (dict(use_dora=True), "invalid_adapter"),
    (dict(bias="all"), "invalid_adapter"),
])
def test_refusals_are_named(tmp_path, kwargs, code):
    path = _adapter(tmp_path / "a", **kwargs)
    with pytest.raises(LoraError) as e:
        read_peft_adapter(path, TABLE, TARGETS, max_rank=8)
    assert e.value.code == code, str(e.value)


def test_a_fused_adapter_splits_b_rows_into_its_parts_with_a_shared(tmp_path):
    """Phi-3's qkv_proj: B [3 * D_OUT, r] rows q, then k, then v; one A for the three."""
    path = _adapter(tmp_path / "a", r=4, alpha=8, module="self_attn.qkv_proj")
    targets = {(0, name): (D_IN, D_OUT) for name in ("q_proj", "k_proj", "v_proj")}
    adapter = read_peft_adapter(path, TABLE, targets, max_rank=8)
    from safetensors.numpy import load_file

    raw = load_file(str(path / "adapter_model.safetensors"))
    a = raw["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"]
    b = raw["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        ours_a, ours_b = adapter.weights[(0, name)]
        np.testing.assert_array_equal(ours_a, a.T)
        np.testing.assert_allclose(ours_b, 2.0 * b[i * D_OUT:(i + 1) * D_OUT].T)  # scale 8 / 4
    with pytest.raises(LoraError) as e:  # a fused module whose parts the model lacks
        read_peft_adapter(path, TABLE, TARGETS, max_rank=8)
    assert e.value.code == "missing_target_module"


def test_a_folder_without_the_files_is_invalid(tmp_path):
    with pytest.raises(LoraError) as e:
        read_peft_adapter(tmp_path, TABLE, TARGETS, max_rank=8)
    assert e.value.code == "invalid_adapter"


def _registry(max_loras=2, rank=8):
    slots = LoraSlots(max_loras, rank)
    weight = LoraWeight(base=jnp.zeros((D_IN, D_OUT)), a=jnp.zeros((D_IN, slots.num_slots * rank)),
                        b=jnp.zeros((slots.num_slots * rank, D_OUT)), num_slots=slots.num_slots, rank=rank)
    runner = types.SimpleNamespace(state={"layers": {0: {"q_proj": weight}}})
    runner.swap_state = lambda update: setattr(runner, "state", update(DeviceState(runner.state, None)).weights)
    return LoraRegistry(runner, slots, TABLE, TARGETS), runner


def test_registry_writes_slots_and_frees_them_only_when_released(tmp_path):
    registry, runner = _registry()
    paths = [_adapter(tmp_path / f"a{i}", seed=i) for i in range(3)]
    assert [registry.load(f"a{i}", paths[i]).slot for i in range(2)] == [1, 2]
    a1 = read_peft_adapter(paths[1], TABLE, TARGETS, 8).weights[(0, "q_proj")]
    stored = runner.state["layers"][0]["q_proj"]
    np.testing.assert_array_equal(np.asarray(stored.a[:, 16:20]), a1[0])  # slot 2 of rank 8: columns 16..23
    np.testing.assert_array_equal(np.asarray(stored.a[:, 20:24]), 0.0)  # rank 4 in a rank-8 slot: zero-padded
    np.testing.assert_allclose(np.asarray(stored.b[16:20]), a1[1])
    np.testing.assert_array_equal(np.asarray(stored.a[:, :8]), 0.0)  # the zero slot stays zero
    with pytest.raises(LoraError) as full:
        registry.load("a2", paths[2])
    assert full.value.code == "slots_full"

    held = registry.acquire("a0")
    registry.unload("a0")
    assert registry.names() == ["a1"]
    with pytest.raises(LoraError):
        registry.acquire("a0")  # the name is gone at once
    with pytest.raises(LoraError):
        registry.load("a2", paths[2])  # ... but its slot is still held by a running request
    registry.release(held.slot)
    assert registry.load("a2", paths[2]).slot == 1, "a released slot is reused"


def _gguf_adapter(path, arch="llama", general_type="adapter", ranks=(4,)):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    rng = np.random.RandomState(0)
    for layer, r in enumerate(ranks):
        writer.add_tensor(f"blk.{layer}.attn_v.weight.lora_a", rng.randn(r, D_IN).astype(np.float32))
        writer.add_tensor(f"blk.{layer}.attn_v.weight.lora_b", rng.randn(D_OUT, r).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kwargs, code", [
    (dict(general_type="model"), "invalid_adapter"),
    (dict(arch="gemma2"), "unsupported_architecture"),
    (dict(ranks=(4, 2)), "invalid_adapter"),
    (dict(ranks=(16,)), "rank_too_large"),
])
def test_gguf_adapter_refusals_are_named(tmp_path, kwargs, code):
    from models.config import ModelConfig
    from models.lora_gguf import read_gguf_adapter
    from models.registry import family_for

    cfg = ModelConfig(vocab_size=32, hidden_size=D_IN, intermediate_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=4, max_position_embeddings=64)
    targets = {(layer, "v_proj"): (D_IN, D_OUT) for layer in range(2)}
    path = _gguf_adapter(tmp_path / "a.gguf", **kwargs)
    with pytest.raises(LoraError) as e:
        read_gguf_adapter(path, family_for("LlamaForCausalLM"), cfg, targets, max_rank=8)
    assert e.value.code == code, str(e.value)


# ---------------------------------------------------------------- what a broken adapter must not do


def _save_adapter(folder, a, b, r=4, alpha=8, **config):
    """A q_proj adapter of layer 0 with the given lora_A [r, in] and lora_B [out, r]."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                            **config}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("which, value", [("A", np.nan), ("B", np.inf), ("A", 1e30), ("B", -2e4)])
def test_an_adapter_with_non_finite_or_absurd_weights_is_refused_naming_the_tensor(tmp_path, which, value):
    a, b = np.full((4, D_IN), 0.01, np.float32), np.full((D_OUT, 4), 0.01, np.float32)
    (a if which == "A" else b)[1, 2] = value
    path = _save_adapter(tmp_path / "bad", a, b)
    with pytest.raises(LoraError) as e:
        read_peft_adapter(path, TABLE, TARGETS, max_rank=8)
    assert e.value.code == "invalid_adapter", str(e.value)
    assert f"q_proj.lora_{which}.weight" in str(e.value) and "adapter_model.safetensors" in str(e.value), \
        f"the refusal names the file and the tensor: {e.value}"


def test_weights_at_a_trained_adapters_scale_load_and_a_huge_lora_alpha_is_refused_once_folded():
    import tempfile
    from pathlib import Path

    from models.lora import MAX_ADAPTER_WEIGHT

    with tempfile.TemporaryDirectory() as tmp:
        a, b = np.full((4, D_IN), 0.5, np.float32), np.full((D_OUT, 4), 0.5, np.float32)
        # 0.5 * (alpha 64 / r 4 = 16) = 8 in the slot: a large but plausible trained adapter
        assert read_peft_adapter(_save_adapter(Path(tmp) / "ok", a, b, alpha=64), TABLE, TARGETS, 8).weights
        big = MAX_ADAPTER_WEIGHT * 4 / 0.5 * 10  # scale (big / 4) * 0.5 = 10 x the bound
        with pytest.raises(LoraError) as e:
            read_peft_adapter(_save_adapter(Path(tmp) / "alpha", a, b, alpha=big), TABLE, TARGETS, 8)
    assert e.value.code == "invalid_adapter" and "lora_B scaled by" in str(e.value), str(e.value)


def _write(folder, config_bytes=None, weights_bytes=None):
    folder.mkdir(parents=True, exist_ok=True)
    good = _adapter(folder)  # then overwrite one of its files
    if config_bytes is not None:
        (good / "adapter_config.json").write_bytes(config_bytes)
    if weights_bytes is not None:
        (good / "adapter_model.safetensors").write_bytes(weights_bytes)
    return good


HUGE_HEADER = (2 ** 40).to_bytes(8, "little") + b"{}"  # a header length far past the file
MALFORMED = {
    "config not JSON": (dict(config_bytes=b"{not json"), "adapter_config.json", "not valid JSON"),
    "config a list": (dict(config_bytes=b"[1, 2]"), "adapter_config.json", "JSON object"),
    "config not UTF-8": (dict(config_bytes=b'{"r": 4, "x": "\xff\xfe"}'), "adapter_config.json", "UTF-8"),
    "r zero": (dict(config_bytes=b'{"r": 0, "lora_alpha": 8}'), "adapter_config.json", "r=0"),
    "r a string": (dict(config_bytes=b'{"r": "4", "lora_alpha": 8}'), "adapter_config.json", "r='4'"),
    "alpha a string": (dict(config_bytes=b'{"r": 4, "lora_alpha": "eight"}'), "adapter_config.json", "lora_alpha"),
    "alpha NaN": (dict(config_bytes=b'{"r": 4, "lora_alpha": NaN}'), "adapter_config.json", "lora_alpha"),
    "garbage weights": (dict(weights_bytes=b"not a safetensors file at all"), "adapter_model.safetensors",
                        "not a readable safetensors file"),
    "huge header": (dict(weights_bytes=HUGE_HEADER), "adapter_model.safetensors", "not a readable safetensors file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_adapter_file_is_refused_naming_the_file_and_the_fault(tmp_path, case):
    files, file_name, what = MALFORMED[case]
    path = _write(tmp_path / "m", **files)
    with pytest.raises(LoraError) as e:
        read_peft_adapter(path, TABLE, TARGETS, max_rank=8)
    assert e.value.code == "invalid_adapter", f"{case}: {e.value}"
    assert f"m/{file_name}" in str(e.value) and what in str(e.value), f"{case}: the message names the file: {e.value}"


@pytest.mark.parametrize("name", ["\ud800", "", "a" * 129, "x/y", "x\\y", "a\x00b", "tab\tx", "a b", "a,b", "\x7f"])
def test_an_unusable_adapter_name_is_refused_before_anything_is_registered(tmp_path, name):
    registry, _ = _registry()
    with pytest.raises(LoraError) as e:
        registry.load(name, _adapter(tmp_path / "a"))
    assert e.value.code == "invalid_lora_name", str(e.value)
    assert registry.names() == [] and registry.adapters() == [], "a refused name registers nothing"
    str(e.value).encode("utf-8")  # the message itself is servable (a lone surrogate is escaped by repr)


def test_a_quarantined_adapter_is_refused_and_listed_until_unloaded_and_loaded_again(tmp_path):
    registry, _ = _registry()
    path = _adapter(tmp_path / "a")
    slot = registry.load("q", path).slot
    held = registry.acquire("q")  # a request running with it when its row faults
    assert registry.quarantine(slot, "its weights produced non-finite logits") == "q"
    assert registry.quarantine(0, "nothing") is None, "slot 0 (the base model) is nobody's adapter"
    with pytest.raises(LoraError) as e:
        registry.acquire("q")
    assert e.value.code == "adapter_quarantined" and "'q'" in str(e.value) and "unload" in str(e.value)
    assert "non-finite" in registry.quarantined_in(held.slot), "the running request learns why"
    assert [a.quarantined for a in registry.adapters()] == ["its weights produced non-finite logits"]
    registry.unload("q")
    registry.release(held.slot)
    registry.load("q", path)
    assert registry.acquire("q").quarantined is None, "unloading and loading again clears the quarantine"


def _adapter_job(name, slot, max_tokens=6):
    from tests.engine.test_batcher import req

    return req(name, 5, max_tokens, adapter_name=f"ad{slot}" if slot else None,
               adapter_key=f"ad{slot}:k" if slot else None)


class _Slots:
    """Adapter "adN" in slot N, never refused (a quarantine is only recorded)."""

    def __init__(self) -> None:
        self.quarantined: list[tuple[int, str]] = []
        self.held: collections.Counter[int] = collections.Counter()

    def refusal(self, name, key):
        return None

    def acquire(self, name):
        self.held[int(name[2:])] += 1
        return types.SimpleNamespace(slot=int(name[2:]))

    def release(self, slot):
        self.held[slot] -= 1

    def quarantine(self, slot, reason):
        self.quarantined.append((slot, reason))
        return f"ad{slot}"


def test_non_finite_rows_of_an_adapter_quarantine_it_and_never_take_the_engine_down():
    """A scripted runner whose rows in slot 2 always come back non-finite; the engine gives
    up after 2 faulted steps in a row, yet survives 6 such requests one after another
    (each its own all-faulted step), and the base model and slot 1 keep answering."""
    from ferrox_jax.batcher import ContinuousBatcher
    from ferrox_jax.step_faults import FaultPolicy
    from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn
    from tests.engine.test_batcher import Sink, limits_for

    runner = ScriptedRunner(token_fn=letters_token_fn())
    sample = runner.sample

    def nan_in_slot_2(pending, bitmask):
        arrays = sample(pending, bitmask)
        arrays.finite = np.asarray(pending.batch.adapter_slots) != 2
        return arrays

    runner.sample = nan_in_slot_2
    adapters = _Slots()
    quarantined = adapters.quarantined
    batcher = ContinuousBatcher(runner, ByteTokenizer(), limits_for(runner),
                                faults=FaultPolicy(max_consecutive_faults=2), adapters=adapters)
    batcher.start()
    try:
        sink = Sink()
        for i in range(6):
            sink.submit(batcher, _adapter_job(f"bad{i}", 2))
            sink.wait(f"bad{i}")
            error = sink.out(f"bad{i}").events[-1].error
            assert "LoRA adapter 'ad2'" in error and "quarantined" in error, error
        assert batcher.health() == "ready", "an adapter's non-finite rows must not count toward the fault streak"
        for name, slot in (("base", 0), ("good", 1)):
            sink.submit(batcher, _adapter_job(name, slot))
            sink.wait(name)
            assert sink.out(name).events[-1].finish_reason == "length", f"{name} keeps answering"
        assert {slot for slot, _ in quarantined} == {2} and "non-finite" in quarantined[0][1]
        stats = batcher.stats()
        assert stats.step_faults_nonfinite == 6 and "quarantined LoRA adapter 'ad2'" in stats.last_step_fault
    finally:
        batcher.shutdown(5)


def test_the_scheduler_holds_a_jobs_adapter_slot_from_admission_to_its_last_row():
    """The engine owns adapters: a job names its adapter, the scheduler acquires the slot
    when it admits the job (a job waiting for a row holds none), its rows run in that slot,
    and the slot is released with its last row; a job whose adapter is refused at admission
    ends with the refusal's code."""
    from ferrox_jax.config import SchedulerLimits
    from ferrox_jax.scheduler import Scheduler
    from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

    slots = _Slots()
    runner = ScriptedRunner(token_fn=letters_token_fn())
    scheduler = Scheduler(SchedulerLimits(block_size=4, num_blocks=64, max_rows=1, max_chunk_tokens=64),
                          ByteTokenizer(), adapters=slots)
    scheduler.add_job(_adapter_job("first", 2, max_tokens=3))
    scheduler.add_job(_adapter_job("second", 3, max_tokens=3))  # waits: one row at a time
    outputs = {}
    tick(scheduler, runner, outputs)
    assert dict(slots.held) == {2: 1}, "admitted: the first job holds slot 2; the waiting one holds nothing"
    assert {int(s) for s in runner.batches[-1].adapter_slots} == {2}, "its rows run in its adapter's slot"
    run_until_idle(scheduler, runner, outputs)
    assert all(n == 0 for n in slots.held.values()) and set(slots.held) == {2, 3}, "released with the last row"
    assert 3 in {int(s) for b in runner.batches for s in b.adapter_slots}

    slots.refusal = lambda name, key: ("adapter_quarantined", f"LoRA adapter {name!r} is quarantined")
    scheduler.add_job(_adapter_job("refused", 2))
    out = run_until_idle(scheduler, runner)[("refused", 0)]
    event = out.events[-1]
    assert (event.finish_reason, event.error_code) == ("error", "adapter_quarantined") and "'ad2'" in event.error
    assert all(n == 0 for n in slots.held.values()), "a refused job never held a slot"
