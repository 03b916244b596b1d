"""Configuration dataclasses, and the only place that reads FERROX_* environment variables.

`BatcherConfig` holds the continuous batcher's limits (the ferrox-server contract's
`FERROX_CB_*` settings). A field left as None is derived when the batcher is built from
the runner it drives: `kv_block_size` and `kv_blocks` from the KV cache, `max_seqs` from the
largest decode row bucket; a None `max_context` means no per-request ceiling beyond the
block budget (the engine normally fills it from the model's trained context).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

# Environment variable -> BatcherConfig field. All are positive integers.
BATCHER_ENV_VARS: dict[str, str] = {
    "FERROX_CB_MAX_SEQS": "max_seqs",
    "FERROX_CB_PREFILL_CHUNK": "prefill_chunk",
    "FERROX_CB_MAX_QUEUE": "max_queue",
    "FERROX_CB_KV_BLOCK_SIZE": "kv_block_size",
    "FERROX_CB_KV_BLOCKS": "kv_blocks",
    "FERROX_CB_MAX_CONTEXT": "max_context",
}


_DERIVED_WHEN_NONE = ("max_seqs", "kv_block_size", "kv_blocks", "max_context")


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    """Limits of the continuous batcher; None means "derive from the runner" (see module doc)."""

    max_seqs: int | None = None  # rows in flight (decoding rows + prefilling prompts' rows)
    prefill_chunk: int = 128  # prompt tokens computed per tick, at most
    max_queue: int = 512  # waiting (not yet admitted) jobs; one more is refused
    kv_block_size: int | None = None  # token positions per KV block; must match the cache
    kv_blocks: int | None = None  # KV cache blocks, the null block 0 included (as Runner.num_blocks)
    max_context: int | None = None  # prompt + max_tokens ceiling per request

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in _DERIVED_WHEN_NONE:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BatcherConfig.{field.name} must be a positive int; got {value!r}")
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise ValueError("BatcherConfig.kv_blocks must be >= 2 (block 0 is the null block); "
                             f"got {self.kv_blocks}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BatcherConfig:
        """Builds a config from FERROX_CB_* variables; overrides (CLI flags) win over them.

        Args:
            environ: the environment to read; `os.environ` when None.
            **overrides: BatcherConfig fields; a None value means "not given" and is skipped,
                so a CLI can pass every flag through unconditionally.

        Returns:
            The validated config.

        Raises:
            ValueError: a variable is not a positive integer (the message names it), or an
                override names an unknown field.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var, field_name in BATCHER_ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            values[field_name] = _parse_positive_int(var, raw)
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"BatcherConfig has no field(s) {', '.join(unknown)}")
        values.update({name: value for name, value in overrides.items() if value is not None})
        return cls(**values)


def _parse_positive_int(var: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{var} must be a positive integer; got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{var} must be a positive integer; got {raw!r}")
    return value
