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

import hashlib
import json
import logging
import pickle
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


CACHE_HIT = "/jax/compilation_cache/cache_hits"  # an executable read from JAX's persistent cache


def _on_duration(event: str, _duration: float, fun_name: str = "", **_kwargs) -> None:
    if _events is not None:
        _events.append((event, fun_name))


def _on_event(event: str, **_kwargs) -> None:
    if _events is not None and event == CACHE_HIT:
        _events.append((event, ""))


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


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


def run(checkpoint: Path, cache_dir: Path, clear: bool = True, **settings) -> dict:
    """Load and warm up an engine on the store, then generate greedily with logprobs.
    Returns its warm-up's compile events by kind, its logprobs (prompt and output, as
    floats), the store entries it sees, and its recompiles after warm-up. `clear=False`
    keeps this process's in-memory lowerings and executables (a long-lived process's)."""
    global _events
    config = EngineConfig(model=str(checkpoint), compile_cache_dir=str(cache_dir), **{**LIMITS, **settings})
    engine = Engine.load(config)
    try:
        if clear:
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
                    cache_hits=sum(event == CACHE_HIT for event, _ in events),
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


def test_a_process_that_ran_its_steps_from_jax_cache_stores_none_of_them_and_serves_right(checkpoint, cache_dir,
                                                                                         tmp_path, caplog):
    """The long-lived process (a pytest worker, a server swapping models, run-batch beside a
    server): it has run these step programs from JAX's persistent cache, so `lowered.compile()`
    hands their executables back from memory, even with JAX's cache suspended, and they
    serialize without object code. Stored, every step of the next engine failed with "Function
    ... not found"; now none is stored, and the engine after compiles and stores whole ones."""
    run(checkpoint, cache_dir, executable_store=False)  # JAX's cache holds every step now
    plain = run(checkpoint, cache_dir, executable_store=False)  # ... and this process ran them from it
    assert plain["cache_hits"] >= plain["shapes"], f"the steps come from JAX's cache: {plain['all_events']}"

    with caplog.at_level(logging.INFO, logger="ferrox_jax.executable_store"):
        reused = run(checkpoint, tmp_path, clear=False)  # a store of its own, this process's memory kept
    after = run(checkpoint, tmp_path)  # what the next engine finds in the store, loaded and run
    assert after["logprobs"] == plain["logprobs"] and after["tokens"] == plain["tokens"], \
        "the next engine computes the same logits (loaded entries without object code failed every step)"
    assert reused["events"][COMPILE] == 0, "JAX served every step from memory: nothing was compiled"
    assert reused["tokens"] == plain["tokens"], "in this process, the executables in memory run"
    assert sum("has no object code" in r.getMessage() for r in caplog.records) == plain["shapes"], \
        "every one of them is refused by the store, with a log line"
    assert after["events"][COMPILE] == plain["shapes"], "it compiled every shape: nothing was stored before"
    (folder, files), = entries(tmp_path).items()
    assert len(files) == plain["shapes"], "compiled whole, each is stored"
    assert all(executable_store.carries_object_code(pickle.loads(f.read_bytes()[len(MAGIC) + hashlib.sha256().digest_size:])[1])
               for f in files), "every stored entry carries its object code"


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


def test_an_executable_without_object_code_is_never_stored_and_never_loaded(tmp_path, caplog):
    """On a small jit: an executable this process read from JAX's cache comes back from memory
    for the next `compile()`, even inside `fresh_compiles` and with no cache-hit event, and its
    serialization has no object code; the store refuses to write it and refuses an entry that
    holds one. Negative control: that payload deserializes without complaint and fails its
    first run, which is what the check keeps from being served."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import serialize_executable

    fn = jax.jit(lambda v: jnp.where(jnp.isfinite(v), v, 0.0) @ v.T + 3)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    jax.clear_caches()
    fn.lower(x).compile()  # JAX's cache holds it now (written here, or by an earlier run)
    jax.clear_caches()
    fn.lower(x).compile()  # read from JAX's cache: this process holds that executable in memory
    store = executable_store.ExecutableStore(tmp_path, "fp")
    with caplog.at_level(logging.INFO, logger="ferrox_jax.executable_store"), store.fresh_compiles():
        again = store.compile(("forward", 3), fn.lower(x))
    np.testing.assert_array_equal(again(x), np.where(np.isfinite(x), x, 0) @ x.T + 3)  # it runs in this process
    assert store.stored == 0 and not list(tmp_path.rglob("*.exe")), "no entry without object code is written"
    assert any("has no object code" in r.getMessage() for r in caplog.records)

    payload, in_tree, out_tree = serialize_executable.serialize(again)
    assert not executable_store.carries_object_code(payload)
    with pytest.raises(Exception, match="not found"):  # the negative control: loaded, its first run fails
        np.asarray(serialize_executable.deserialize_and_load(payload, in_tree, out_tree)(x))

    # Written by hand (as the store did before it checked), the entry is a miss, logged.
    body = pickle.dumps((("forward", 3), payload, in_tree, out_tree))
    store.folder.mkdir(parents=True)
    (store.folder / executable_store.entry_name(("forward", 3))).write_bytes(
        MAGIC + hashlib.sha256(body).digest() + body)
    with caplog.at_level(logging.WARNING, logger="ferrox_jax.executable_store"):
        assert store.load(("forward", 3)) is None and store.loaded == 0
    assert any("no object code" in r.getMessage() and "did not load" in r.getMessage() for r in caplog.records)

    jax.clear_caches()  # compiled whole, the same program is stored and carries its object code
    with store.fresh_compiles():
        store.compile(("forward", 3), fn.lower(x))
    loaded = store.load(("forward", 3))
    assert store.stored == 1 and loaded is not None
    np.testing.assert_array_equal(loaded(x), again(x))
