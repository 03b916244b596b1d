"""The runner's declared surface (`ferrox_jax/runner_protocol.py`): every runner implements the
whole `Runner` protocol and offers nothing else public, so no caller needs to duck-type
around one (the device's runner, the multi-host wrappers, and the tests' scripted double
and fault-injection wrapper alike)."""

from __future__ import annotations

import inspect

import pytest

from ferrox_jax.multihost_runner import BroadcastRunner, DraftSender
from ferrox_jax.runner import ModelRunner
from ferrox_jax.runner_protocol import Runner
from tests.support.faults import FaultyRunner
from tests.support.scripted import ScriptedRunner

# ModelRunner's one public method beside the protocol: offline scoring for parity checks
# (tests, tools/parity/compare_logits.py), never called by the owner loop.
OFFLINE = {"run_logits"}


def _methods(cls) -> dict[str, inspect.Signature]:
    """Public methods (properties excluded) and their signatures."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        value = getattr(cls, name)
        if callable(value):
            out[name] = inspect.signature(value)
    return out


def _queries() -> set[str]:
    """The protocol's attributes and properties."""
    properties = {name for name, v in vars(Runner).items() if isinstance(v, property)}
    return set(Runner.__annotations__) | properties


def _parameters(signature: inspect.Signature) -> list[str]:
    return [p for p in signature.parameters if p != "self"]


VERBS = _methods(Runner)


def test_the_protocol_declares_the_verbs_the_tick_and_the_state_changes_use():
    assert set(VERBS) == {"forward", "sample", "copy_blocks", "encode_images", "offload_blocks", "warmup",
                          "compile_keys", "swap_state", "release", "restore"}
    assert {"geometry", "recompiles_after_warmup", "is_warm", "max_loras", "sleep_level"} <= _queries()


@pytest.mark.parametrize("cls, extra", [(ModelRunner, OFFLINE), (ScriptedRunner, set()), (BroadcastRunner, set()),
                                        (DraftSender, set()), (FaultyRunner, set())],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_every_runner_implements_the_whole_protocol_and_nothing_else_public(cls, extra):
    methods = _methods(cls)
    assert set(methods) == set(VERBS) | extra, f"{cls.__name__}'s public methods are not the protocol's"
    for name, signature in VERBS.items():
        assert _parameters(methods[name]) == _parameters(signature), f"{cls.__name__}.{name} takes other arguments"


def test_runner_instances_answer_every_query_of_the_protocol(tiny_llama):
    from tests.support.engine_helpers import make_runner

    model_runner, _ = make_runner(tiny_llama)
    scripted = ScriptedRunner()
    channel = object()  # the wrappers only hold it until a verb sends
    for runner in (model_runner, scripted, BroadcastRunner(scripted, channel), DraftSender(model_runner, channel),
                   FaultyRunner(scripted)):
        missing = [name for name in _queries() if not hasattr(runner, name)]
        assert not missing, f"{type(runner).__name__} lacks {missing}"
        assert runner.sleep_level == 0 and runner.recompiles_after_warmup == 0
