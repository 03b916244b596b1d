"""Fixtures every tier shares: tiny random checkpoints on disk, the persistent compile cache.

The suite mirrors the tree, one folder per tier (a package each, so a test module is
`tests.<tier>.<module>` under pytest and its xdist workers alike):

    engine/   ferrox_jax/ without HTTP: scheduler, batcher, block budget, buckets, host batch,
              runner, speculation, grammar, sampling (the scripted runner or a tiny model)
    models/   models/: layers, attention, kernels, families against transformers, loaders,
              quantization, tokenizer (tiny shapes, plus the default model's checks)
    server/   api/: routes driven in-process (`support.server_harness.ServerThread` over a
              shared tiny engine) and the API's own modules without a server
    system/   whole processes: `ferrox serve` and the CLI as subprocesses, several devices or
              processes, the browser, the router, the soak, lm-eval
    tools/    tools/ and the tree's own rules (layering, product tree, the suite's timings)
    support/  what the tiers share (no tests): tiny checkpoints, the scripted runner, the
              server harness, fault injection, and the probes run as subprocesses

`make test-fast` runs the engine, models and server tiers less their dearest files (the
Makefile lists them and says why); `make test` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.xla_flags import suite_flags

# Tests compile the same tiny shapes in many modules; the persistent cache makes the
# second compile of an identical program a disk read.
_CACHE = Path(__file__).resolve().parent.parent / ".jax_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite compiles with LLVM's optimizations and XLA CPU's fusion emitters off on CPU
# (tests/support/xla_flags.py: each a fifth to a third less compile time), set before any
# test starts JAX's backend; the processes the tests start inherit them, or take them
# through `with_devices`.
os.environ["XLA_FLAGS"] = suite_flags(os.environ.get("XLA_FLAGS", ""))
# Servers and CLI runs started by the tests (in this process or as subprocesses) keep to
# JAX's cache, not the executable store, for speed: the store is keyed by the checkpoint's
# path, and the tests' checkpoints are new temporary folders each run, so every store would
# miss, and a miss compiles with JAX's cache suspended (the store keeps only whole
# executables): each server would compile its shapes cold instead of reading JAX's cache.
# It is safe in a long-lived process now (an executable without object code is never
# stored nor loaded; before, a clean clone's run-batch test stored the worker's in-memory
# executables read from JAX's cache and failed every step with "Function ... not found").
# The store's own tests build their engines with it on, the long-lived process among them
# (tests/engine/test_executable_store.py).
os.environ.setdefault("FERROX_EXECUTABLE_STORE", "0")

# Property tests (the scheduler's state machines, the request fuzzers) draw the same
# examples on every run, seeded from each test's own hash: a red run is the code's doing
# and repeats, never a draw nobody can reproduce. A test's own settings inherit this
# profile; `pytest --hypothesis-profile=default` draws fresh examples when hunting.
# Guarded: the accelerator image runs the device tests without hypothesis.
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:
    pass
else:
    _hypothesis_settings.register_profile("derandomized", derandomize=True, database=None)
    _hypothesis_settings.load_profile("derandomized")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Lazily built tiny HF folders by variant ("llama", "qwen2", "llama3_rope")."""
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def get(variant: str = "llama") -> Path:
        if variant not in made:
            made[variant] = make_tiny_checkpoint(root / variant, variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")


# Clients of a module's own `server` fixture (a base URL); a module may override them.
@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


# `make test` runs the files on two pytest-xdist workers, a file at a time each
# (`--dist loadfile --no-loadscope-reorder`): a worker that finishes takes the next file
# in collection order. Files go dearest first (their seconds in tests/durations.json,
# written by `python -m tools.suite.test_durations` from a run's JUnit XML), so the long ones
# start at once and the short ones fill in at the end, instead of one worker running a
# 10-minute file alone at the end. A file not in the table goes before every file in it:
# a new file is often a dear one (engines, subprocesses), and one that starts late can
# hold one worker long after the other finished, where a cheap one started early costs
# nothing (the short files at the end still even the two workers out).
_DURATIONS = Path(__file__).resolve().parent / "durations.json"


def file_order(files: list[str], seconds: dict[str, float]) -> list[str]:
    """`files` (in collection order) as `make test` runs them: those `seconds` lacks first,
    in collection order, then the rest dearest first (ties in collection order)."""
    first_seen = {name: i for i, name in enumerate(files)}
    return sorted(files, key=lambda name: (name in seconds, -seconds.get(name, 0.0), first_seen[name]))


def pytest_collection_modifyitems(config, items):
    import json

    if not _DURATIONS.exists():
        return
    seconds = json.loads(_DURATIONS.read_text())["seconds"]
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {name: i for i, name in enumerate(file_order(files, seconds))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: a file's tests keep their order
