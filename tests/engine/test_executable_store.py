"""The executable store (`ferrox_jax/executable_store.py`): a second engine on the same store
loads every step executable without tracing a step function and computes the same logits
bit for bit; a corrupt entry, or a rewritten checkpoint, is compiled again; and the negative
control: a key that does not see the checkpoint change loads the old executables and the
logits come out wrong, which is why the file's identity is in the key.

One tiny Llama (2 layers, hidden 64) copied into this module's own folder (the test
rewrites its config.json), engines of 2 rows and 16-token chunks so the warm-up compiles a
handful of shapes. Traces are counted with JAX's own monitoring events (one per jaxpr
trace, one per lowering, one per XLA compile) during each warm-up, after `jax.clear_caches()`
so that nothing of an earlier engine's traces is reused in memory.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import pytest

from ferrox_jax import LLM, SamplingParams, executable_store
from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.executable_store import MAGIC, STORE_FOLDER, program_fingerprint
from models import cpu_kernels

# Decode attention through our CPU kernel where it is built: a custom call the stored programs
# must carry by name and find again when they load.
KERNEL = cpu_kernels.unavailable_reason() is None
LIMITS = dict(dtype="float32", block_size=8, kv_blocks=40, max_seqs=1, prefill_chunk=16, max_context=64,
              attention_impl="cpu" if KERNEL else "jax")
PROMPT = "The capital of France is Paris. The capital of Italy is"
TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                         "/jax/core/compile/backend_compile_duration")
# The step functions' names as JAX reports them ("_forward" traced, "jit(_forward)" lowered and
# compiled: ferrox_jax/step.py's bodies, the block copy):
# lowering the steps also compiles small helpers (the zeros it lowers with), not counted.
STEP_FUNCTIONS = ("_forward", "_sample", "copy_blocks")
_events: list[tuple[str, str]] | None = None  # (event, function) during a warm-up; None: not recording


def _on_duration(event: str, _duration: float, fun_name: str = "", **_kwargs) -> None:
    if _events is not None:
        _events.append((event, fun_name))


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path_factory.mktemp("store") / "tiny"))


@pytest.fixture(scope="module")
def cache_dir():
    """The tests' JAX cache dir (the process's; an engine sets it once a process), with the
    store folders this module makes removed afterwards."""
    root = Path(jax.config.jax_compilation_cache_dir)
    before = set((root / STORE_FOLDER).glob("*"))
    yield root
    for folder in set((root / STORE_FOLDER).glob("*")) - before:
        shutil.rmtree(folder, ignore_errors=True)


def run(checkpoint: Path, cache_dir: Path, **settings) -> dict:
    """Load and warm up an engine on the store, then generate greedily with logprobs.
    Returns its warm-up's compile events by kind, its logprobs (prompt and output, as
    floats), the store entries it sees, and its recompiles after warm-up."""
    global _events
    config = EngineConfig(model=str(checkpoint), compile_cache_dir=str(cache_dir), **{**LIMITS, **settings})
    engine = Engine.load(config)
    try:
        jax.clear_caches()  # module docstring: no in-memory trace of an earlier engine is reused
        _events = []
        engine.warmup()
        events, _events = _events, None
        engine.start()
        out = LLM.from_engine(engine).generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=3), use_tqdm=False)[0]
        logprobs = [lp.logprob for step in out.outputs[0].logprobs for lp in step.values()]
        logprobs += [lp.logprob for step in out.prompt_logprobs if step for lp in step.values()]
        steps = [event for event, fun in events if fun.removeprefix("jit(").removesuffix(")") in STEP_FUNCTIONS]
        return dict(events={k: steps.count(k) for k in (TRACE, LOWER, COMPILE)}, all_events=events, logprobs=logprobs,
                    tokens=list(out.outputs[0].token_ids), shapes=engine.describe()["num_compiled_shapes"],
                    attention=engine.describe()["attention"], recompiles=engine.stats().recompiles_after_warmup)
    finally:
        engine.shutdown()


def entries(cache_dir: Path) -> dict[Path, list[Path]]:
    return {f: sorted(f.glob("*.exe")) for f in (cache_dir / STORE_FOLDER).glob("*")}


def test_a_restart_loads_every_executable_untraced_and_a_changed_model_compiles_again(checkpoint, cache_dir,
                                                                                     monkeypatch, caplog):
    before = entries(cache_dir)
    first = run(checkpoint, cache_dir)
    made = {f: e for f, e in entries(cache_dir).items() if f not in before}
    assert len(made) == 1, f"the first engine should fill one store folder; made {list(made)}"
    (folder, files), = made.items()
    assert len(files) == first["shapes"], f"every compiled shape is stored ({len(files)} of {first['shapes']})"
    assert first["events"] == {TRACE: first["shapes"], LOWER: first["shapes"], COMPILE: first["shapes"]}, \
        f"the first engine traces, lowers and compiles every shape itself: {first['all_events']}"
    if KERNEL:  # the decode steps call our kernel (and run it below, loaded)
        assert "CPU kernel" in first["attention"], first["attention"]
        assert any(cpu_kernels.ATTENTION_TARGET.encode() in f.read_bytes() for f in files), \
            "the stored decode programs carry the kernel's custom call"

    second = run(checkpoint, cache_dir)
    assert second["events"] == {TRACE: 0, LOWER: 0, COMPILE: 0}, \
        f"a restart on the store must not trace, lower or compile a step: {second['events']}"
    assert second["logprobs"] == first["logprobs"] and second["tokens"] == first["tokens"], \
        "the loaded executables compute the same logits, bit for bit"
    assert second["recompiles"] == 0 and len(second["logprobs"]) > 20

    # A corrupt entry is logged and compiled again (only it), then rewritten whole.
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ferrox_jax.executable_store"):
        third = run(checkpoint, cache_dir)
    assert any("is corrupt" in r.getMessage() and victim.name in r.getMessage() for r in caplog.records)
    assert third["events"][COMPILE] == 1 and third["events"][TRACE] >= 1, \
        f"only the corrupt entry is compiled again (and the counter sees a trace): {third['events']}"
    assert third["logprobs"] == first["logprobs"]
    assert victim.read_bytes().startswith(MAGIC) and victim.read_bytes() != bytes(data), "the entry is rewritten"

    # The checkpoint rewritten in place (another RoPE base: the same weights and shapes, a
    # different program): its key changes, so the engine compiles, and its logits move.
    stale_identity = executable_store.file_identity(str(checkpoint))
    config_path = checkpoint / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["rope_parameters"]["rope_theta"] = 500.0  # transformers 5 keeps the base here
    config_path.write_text(json.dumps(cfg))
    rewritten = run(checkpoint, cache_dir)
    assert rewritten["events"][COMPILE] == first["shapes"], "a rewritten checkpoint is a new program: compiled"
    assert rewritten["logprobs"] != first["logprobs"], "the RoPE base reaches the logits"

    # Negative control: a key blind to the rewrite (the file's old identity) finds the old
    # program's executables and loads them: the logits are the old model's, not this one's.
    real = executable_store.file_identity
    monkeypatch.setattr(executable_store, "file_identity",
                        lambda path: stale_identity if path == str(checkpoint) else real(path))
    stale = run(checkpoint, cache_dir)
    assert stale["events"][COMPILE] == 0, "the blind key loads every executable of the old program"
    assert stale["logprobs"] == first["logprobs"] != rewritten["logprobs"], \
        "a key without the checkpoint's identity would serve the old program's logits"


def test_the_fingerprint_sees_program_settings_and_ignores_host_side_ones(checkpoint):
    base = EngineConfig(model=str(checkpoint), **LIMITS)
    fp = program_fingerprint(base, str(checkpoint))
    for change in (dict(max_context=128), dict(block_size=16), dict(dtype="bfloat16"), dict(max_seqs=4),
                   dict(quantization="int8"), dict(attention_impl="jax")):
        changed = EngineConfig(**{**base.__dict__, **change})
        assert program_fingerprint(changed, str(checkpoint)) != fp, f"{change} reaches the step functions"
    for change in (dict(served_model_name="x"), dict(max_queue=3), dict(step_timeout_s=5.0),
                   dict(compile_cache_dir="/elsewhere")):
        same = EngineConfig(**{**base.__dict__, **change})
        assert program_fingerprint(same, str(checkpoint)) == fp, f"{change} is host-side: the same programs"
    executable_store.code_version.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(executable_store, "SOURCE_ROOTS", ("ferrox_jax",))  # another code version
            assert program_fingerprint(base, str(checkpoint)) != fp, "our code version is in the key"
    finally:
        executable_store.code_version.cache_clear()


def test_an_entry_round_trips_and_every_unusable_one_is_a_miss_not_a_crash(tmp_path, caplog):
    """The store alone, on a small jitted function: a stored executable loads and computes
    the same; a truncated entry, an entry under another key's name and garbage each load as
    None with a log line; a folder that cannot be written costs a log line, no exception."""
    import jax.numpy as jnp
    import numpy as np

    fn = jax.jit(lambda x, y: {"out": jnp.sin(x) @ y + 1})
    x, y = np.ones((4, 4), np.float32), np.arange(16, dtype=np.float32).reshape(4, 4)
    store = executable_store.ExecutableStore(tmp_path, "fp")
    with store.fresh_compiles():  # as the warm-up compiles a miss
        compiled = store.compile(("forward", 4), fn.lower(x, y))
    loaded = store.load(("forward", 4))
    assert loaded is not None and store.loaded == 1 and store.stored == 1
    np.testing.assert_array_equal(loaded(x, y)["out"], compiled(x, y)["out"])  # same program, same bits
    assert store.load(("forward", 8)) is None, "nothing stored under another key"

    entry = store.folder / executable_store.entry_name(("forward", 4))
    whole = entry.read_bytes()
    cases = {"truncated": whole[:len(whole) // 3], "garbage": b"not an executable at all",
             "empty": b""}
    with caplog.at_level(logging.WARNING, logger="ferrox_jax.executable_store"):
        for name, data in cases.items():
            entry.write_bytes(data)
            assert store.load(("forward", 4)) is None, f"a {name} entry is a miss"
        # A whole, valid entry of another key copied under this key's name: refused by its key.
        with store.fresh_compiles():
            store.compile(("forward", 2), fn.lower(x[:2], y))
        entry.write_bytes((store.folder / executable_store.entry_name(("forward", 2))).read_bytes())
        assert store.load(("forward", 4)) is None, "an entry holding another key is a miss"
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == len(cases)
    assert any("did not load" in r.getMessage() and "('forward', 2)" in r.getMessage() for r in caplog.records)

    # What `compile` refuses to store: an executable read back from JAX's cache (on CPU it
    # serializes without its object code; loaded, it fails its first run).
    jax.clear_caches()  # else this compile is served from memory (the store's own) and JAX writes nothing
    fn.lower(x, y).compile()  # JAX's cache holds it now (written here, or by an earlier run)
    jax.clear_caches()  # so the next compile reads it from disk, not this process's memory
    reader = executable_store.ExecutableStore(tmp_path, "fp2")
    with caplog.at_level(logging.INFO, logger="ferrox_jax.executable_store"):
        reader.compile(("forward", 4), fn.lower(x, y))
    assert reader.stored == 0 and reader.load(("forward", 4)) is None
    assert any("came from JAX's compile cache" in r.getMessage() for r in caplog.records)

    blocked = tmp_path / "file"
    blocked.write_text("a file where the store's folder would go")
    with caplog.at_level(logging.WARNING, logger="ferrox_jax.executable_store"):
        executable_store.ExecutableStore(blocked, "fp").save(("forward", 4), compiled)
    assert any("could not store" in r.getMessage() for r in caplog.records)


def test_fresh_compiles_suspend_jax_cache_and_restore_it(tmp_path):
    """Inside, JAX's persistent cache is off (the compile is whole, storable); after, it is
    back as it was, and a new program is written to it again."""
    import jax.numpy as jnp

    import time

    def new_program(tag: int):  # a constant of its own: a program JAX's cache has never seen
        constant = float(time.time_ns() % 10**9 + tag)

        def fresh_probe(v):
            return v * constant

        return jax.jit(fresh_probe).lower(jnp.ones(3)).compile()

    def probes() -> set[Path]:  # this test's entries only: other processes share the folder
        return set(Path(jax.config.jax_compilation_cache_dir).glob("jit_fresh_probe-*"))

    store = executable_store.ExecutableStore(tmp_path, "fp")
    was = jax.config.jax_enable_compilation_cache
    before = probes()
    with store.fresh_compiles():
        assert jax.config.jax_enable_compilation_cache is False
        new_program(1)
    assert probes() == before, "nothing goes through JAX's cache while it is suspended"
    assert jax.config.jax_enable_compilation_cache == was
    new_program(2)
    made = probes() - before
    assert made, "JAX's cache writes again after the suspension"
    for path in made:  # a probe nobody reads again
        path.unlink(missing_ok=True)
