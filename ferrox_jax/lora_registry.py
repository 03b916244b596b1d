"""LoraRegistry: which LoRA adapter sits in which device slot, and loading one at run time.

The model's target projections carry `max_loras + 1` adapter slots (`models/lora.py`;
slot 0 is the zero slot, the base model). The registry maps adapter names to slots 1..M:

    read(name, path)    read and check the PEFT folder (or a llama.cpp GGUF LoRA file,
                        `*.gguf`): any thread, no device state touched
    place(read)         pick a free slot, write its A/B there: the owner thread, between
                        ticks (`Engine.load_adapter` sends it there as a message)
    acquire(name)       a job is admitted with the adapter (the scheduler, after `refusal`
                        said it may be): its slot is held until `release` (the job's
                        last row's end: `ferrox_jax/admission.py`)
    unload(name)        the name stops resolving at once; its slot is freed when the
                        last request holding it releases it, so a running request never
                        sees its slot refilled with another adapter mid-generation

    quarantine(slot)    the owner thread found non-finite logits in a row of the adapter in
                        `slot` (`ferrox_jax/batcher.py`): acquiring it is refused from
                        then on ("adapter_quarantined"), until it is unloaded and loaded
                        again (a new load starts clean)

Placing writes new arrays of the same shapes into the runner's weights (`write_slot`,
through the runner's `swap_state` verb) on the owner thread between two ticks, so a step
runs wholly on the old or wholly on the new slots, no HTTP thread touches device state,
and the compiled forwards take the new weights as they took the old (no recompile). Every
change to the registry runs on the owner thread: loads and unloads are messages to it
(`Engine.load_adapter` / `unload_adapter`), the scheduler acquires and releases slots,
the batcher quarantines; the bookkeeping is under a lock because the API lists adapters
and resolves names (`Engine.resolve_adapter`) from its own threads.

A name is checked before anything is read or registered (`check_adapter_name`): it is
served as a model id, listed in JSON, written in plain-text replies and joined into a
metrics label, so it must be printable UTF-8 of at most `MAX_ADAPTER_NAME_CHARS`
characters, without whitespace, slashes or commas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

from models.lora import ADAPTER_WEIGHTS, LoraError, LoraSlots, read_peft_adapter, write_slot

MAX_ADAPTER_NAME_CHARS = 128
_NAME_FORBIDDEN = "/\\,"  # path separators (names are not paths) and the metrics label's list separator


def check_adapter_name(name: str) -> None:
    """Raises LoraError("invalid_lora_name") naming what is wrong with an adapter name."""
    if not 1 <= len(name) <= MAX_ADAPTER_NAME_CHARS:
        raise LoraError("invalid_lora_name", f"a LoRA adapter name must be 1 to {MAX_ADAPTER_NAME_CHARS} characters; "
                                             f"got {len(name)}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise LoraError("invalid_lora_name", f"LoRA adapter name {name!r} is not valid UTF-8 (a lone surrogate); "
                                             "use letters, digits, '-', '_' or '.'") from None
    bad = next((c for c in name if not c.isprintable() or c.isspace() or c in _NAME_FORBIDDEN), None)
    if bad is not None:
        raise LoraError("invalid_lora_name", f"LoRA adapter name {name!r} contains {bad!r}: control characters, "
                                             "whitespace, slashes and commas are not allowed; use letters, digits, "
                                             "'-', '_' or '.'")


@dataclasses.dataclass(frozen=True)
class ReadAdapter:
    """An adapter's files, read and checked (`LoraRegistry.read`), not yet in a slot."""

    name: str
    path: Path
    adapter: Any  # models/lora.py's PeftAdapter: rank and per-target (A, B)
    digest: str  # of its weights file (part of the adapter's key)


@dataclasses.dataclass
class LoadedAdapter:
    """One adapter in a slot."""

    name: str
    path: str
    slot: int
    rank: int
    key: str  # name + a digest of its weights (the prefix cache's salt)
    loaded_at: float = dataclasses.field(default_factory=time.time)
    num_running: int = 0  # jobs holding the slot now (admitted, not ended)
    num_requests: int = 0  # requests that named it since it was loaded (`resolve`)
    is_unloaded: bool = False  # unloaded; the slot frees when num_running reaches 0
    quarantined: str | None = None  # why its requests are refused (a faulted row), until unloaded


class LoraRegistry:
    """Adapter names <-> device slots of one runner (see the module docstring)."""

    def __init__(self, runner, slots: LoraSlots, hf_layer_weights: dict[str, str],
                 targets: dict[tuple[int, str], tuple[int, int]], model_config=None):
        """Args:
          runner: the runner whose weights hold the LoraWeights (`attach_lora`); written
            only through its `swap_state` verb.
          hf_layer_weights: the family's HF -> ours layer table (PEFT names map through it).
          targets: {(layer, name): (in, out)} of the projections with slots.
          model_config: the model's `ModelConfig` (a GGUF LoRA file's names map through its family).
        """
        self.runner = runner
        self.model_config = model_config
        self.slots = slots
        self._table = hf_layer_weights
        self._targets = targets
        self._lock = threading.Lock()
        self._by_name: dict[str, LoadedAdapter] = {}
        self._by_slot: dict[int, LoadedAdapter] = {}  # unloaded ones stay until released

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    @property
    def targets(self) -> dict[tuple[int, str], tuple[int, int]]:
        """{(layer, name): (in, out)} of the projections with slots."""
        return dict(self._targets)

    def names(self) -> list[str]:
        """Loaded adapters, in load order."""
        with self._lock:
            return list(self._by_name)

    def adapters(self) -> list[LoadedAdapter]:
        with self._lock:
            return [dataclasses.replace(a) for a in self._by_name.values()]

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """`place(read(name, path))`, on one thread: the builder's start-up adapters and the
        tests' registries, which no owner thread runs beside (the engine's runtime loads
        split the two: `Engine.load_adapter`)."""
        return self.place(self.read(name, path))

    def read(self, name: str, path: str | Path) -> ReadAdapter:
        """Reads and checks an adapter's files (any thread: no device state is touched).

        Raises:
          LoraError: "invalid_lora_name" (checked first), or what `read_peft_adapter` /
            `read_gguf_adapter` raises (prefixed with the name).
        """
        check_adapter_name(name)
        path = Path(path)
        try:
            adapter, weights_file = self._read(path)
            digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()[:16]
        except LoraError as e:
            raise LoraError(e.code, f"LoRA adapter {name!r}: {e}") from None
        except OSError as e:
            raise LoraError("invalid_adapter", f"LoRA adapter {name!r}: {path.name} cannot be read "
                                               f"({e.strerror or e})") from None
        return ReadAdapter(name, path, adapter, digest)

    def place(self, read: ReadAdapter) -> LoadedAdapter:
        """Writes a read adapter into a free slot and registers its name (the owner thread,
        between ticks: the slot write swaps the runner's weights).

        Raises:
          LoraError: "adapter_exists", "slots_full".
        """
        name = read.name
        with self._lock:
            if name in self._by_name:
                raise LoraError("adapter_exists", f"a LoRA adapter named {name!r} is already loaded")
            free = [s for s in range(1, self.slots.num_slots) if s not in self._by_slot]
            if not free:
                raise LoraError("slots_full", f"all {self.slots.max_loras} LoRA slots (--max-loras) are in use")
            loaded = LoadedAdapter(name=name, path=str(read.path), slot=free[0], rank=read.adapter.rank,
                                   key=f"{name}:{read.digest}")
            self._write(loaded.slot, read.adapter.weights)
            self._by_name[name] = self._by_slot[loaded.slot] = loaded
        return loaded

    def _read(self, path: Path):
        """(the adapter, the file its weights are in): a `.gguf` file is a llama.cpp LoRA
        adapter (`models/lora_gguf.py`), anything else a PEFT folder."""
        if path.suffix == ".gguf" and path.is_file():
            from models.lora_gguf import read_gguf_adapter
            from models.registry import family_for

            cfg = self.model_config
            return read_gguf_adapter(path, family_for(cfg.architecture), cfg, self._targets,
                                     self.slots.max_rank), path
        return read_peft_adapter(path, self._table, self._targets, self.slots.max_rank), path / ADAPTER_WEIGHTS

    def unload(self, name: str) -> None:
        """Raises LoraError("adapter_not_found") for a name not loaded."""
        with self._lock:
            loaded = self._by_name.pop(name, None)
            if loaded is None:
                raise LoraError("adapter_not_found", f"no LoRA adapter named {name!r} is loaded")
            loaded.is_unloaded = True
            if loaded.num_running == 0:
                del self._by_slot[loaded.slot]

    def refusal(self, name: str, key: str | None) -> tuple[str, str] | None:
        """Why a job naming adapter `name` at version `key` (None: any) cannot run now, as
        (code, message): not loaded ("adapter_not_found", also when it was loaded again
        with other weights since the job named it) or "adapter_quarantined"; None when it
        can (`ferrox_jax/admission.py`)."""
        with self._lock:
            loaded = self._by_name.get(name)
            if loaded is None:
                return "adapter_not_found", f"no LoRA adapter named {name!r} is loaded"
            if loaded.quarantined is not None:
                return "adapter_quarantined", quarantine_message(loaded)
            if key is not None and key != loaded.key:
                return "adapter_not_found", (f"LoRA adapter {name!r} was loaded again with other weights after the "
                                             "request named it; send the request again")
            return None

    def resolve(self, name: str) -> str:
        """A request names the adapter (any thread): counted in `num_requests` (whether the
        engine or the response cache answers it); returns its key (name + weights digest).

        Raises LoraError("adapter_not_found"), or ("adapter_quarantined")."""
        with self._lock:
            loaded = self._servable(name)
            loaded.num_requests += 1
            return loaded.key

    def acquire(self, name: str) -> LoadedAdapter:
        """Hold the adapter's slot for one request.

        Raises LoraError("adapter_not_found"), or ("adapter_quarantined") for an adapter a
        faulted row quarantined (the message says how to clear it)."""
        with self._lock:
            loaded = self._servable(name)
            loaded.num_running += 1
            return dataclasses.replace(loaded)

    def _servable(self, name: str) -> LoadedAdapter:
        """The adapter `name`, loaded and not quarantined (under the lock).

        Raises LoraError("adapter_not_found"), or ("adapter_quarantined")."""
        loaded = self._by_name.get(name)
        if loaded is None:
            raise LoraError("adapter_not_found", f"no LoRA adapter named {name!r} is loaded")
        if loaded.quarantined is not None:
            raise LoraError("adapter_quarantined", quarantine_message(loaded))
        return loaded

    def release(self, slot: int) -> None:
        """The request holding `slot` ended (finished, failed or cancelled)."""
        with self._lock:
            loaded = self._by_slot.get(slot)
            if loaded is None:
                return
            loaded.num_running -= 1
            assert loaded.num_running >= 0, f"LoRA slot {slot} released more often than acquired"
            if loaded.is_unloaded and loaded.num_running == 0:
                del self._by_slot[slot]

    def quarantine(self, slot: int, reason: str) -> str | None:
        """Quarantine the adapter in `slot` (the owner thread, after a row of it faulted);
        returns its name, None when no adapter holds the slot. The first reason is kept."""
        with self._lock:
            loaded = self._by_slot.get(slot)
            if loaded is None:
                return None
            if loaded.quarantined is None:
                loaded.quarantined = reason
            return loaded.name

    def quarantined_in(self, slot: int) -> str | None:
        """What a request holding `slot` is told when its adapter is quarantined; else None.

        Read without the lock: it is asked on the event loop at every event of an adapter's
        request, and `load` holds the lock through a slot write on the device. One dict
        lookup and one attribute read are atomic, and the slot is the caller's (it holds it),
        so the adapter found is its own."""
        loaded = self._by_slot.get(slot)
        return None if loaded is None or loaded.quarantined is None else quarantine_message(loaded)

    def _write(self, slot: int, weights) -> None:
        """The runner's weights with `slot` holding `weights` (its `swap_state` verb places
        them as the old ones were, so the compiled steps take them without a recompile)."""
        self.runner.swap_state(lambda state: state._replace(
            weights=write_slot(state.weights, slot, weights, self.slots.max_rank)))


def quarantine_message(loaded: LoadedAdapter) -> str:
    return (f"LoRA adapter {loaded.name!r} is quarantined: {loaded.quarantined}. Its requests are refused until "
            "it is unloaded (POST /v1/unload_lora_adapter) and loaded again with fixed weights")


def build_registry(runner, model_config, slots: LoraSlots, targets: dict[tuple[int, str], tuple[int, int]],
                   modules: tuple[tuple[str, str], ...] = ()) -> LoraRegistry:
    """The registry of a runner whose model `attach_lora` wrapped, with the start-up
    adapters (`--lora-modules`) loaded.

    Raises:
      LoraError("unsupported_architecture") when the model has no projection LoRA can
      target, or what `load` raises for a start-up adapter (named)."""
    from models.registry import family_for

    architecture = model_config.architecture
    if not targets:
        raise LoraError("unsupported_architecture", f"{architecture} has no projection LoRA can target "
                                                    f"(--max-loras needs q/k/v/o, dense MLP or DeltaNet projections)")
    registry = LoraRegistry(runner, slots, family_for(architecture).hf_layer_weights, targets, model_config)
    for name, path in modules:
        try:
            registry.load(name, path)
        except LoraError as e:
            raise LoraError(e.code, f"--lora-modules {name}={path}: {e}") from None
    return registry
