"""ferrox_jax: the engine (scheduler, block budget, runner, jitted steps) and the offline API.

`from ferrox_jax import LLM, SamplingParams` is the offline API (`ferrox_jax/llm.py`,
`ferrox_jax/offline.py`: vLLM's names). They are imported on first use (module
`__getattr__`), so importing the package, or a scheduler-side module under it, stays free
of jax (tests/tools/test_layering.py).
"""

from __future__ import annotations

from typing import Any

# public name -> the module that defines it
_LAZY = {
    "LLM": "ferrox_jax.llm",
    "SamplingParams": "ferrox_jax.offline",
    "StructuredOutputsParams": "ferrox_jax.offline",
    "RequestOutput": "ferrox_jax.offline",
    "CompletionOutput": "ferrox_jax.offline",
    "Logprob": "ferrox_jax.offline",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ferrox_jax' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
