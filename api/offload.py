"""CPU-heavy request steps run in a small, bounded thread pool, never on the event loop.

Rendering a chat template over 60,000 messages, tokenizing a megabyte, compiling a
grammar or validating a large body each take from tens of milliseconds to seconds of
CPU. On the event loop they stall every connection, `/health` included: eight such
requests at once held it for 27 s, long enough for a liveness probe to restart the
server. `run_cpu(fn, *args)` runs the step on one of `--cpu-workers` threads
(FERROX_CPU_WORKERS, default 2): at most that many run at once, the rest queue in the pool,
and the loop keeps answering. Python code in the pool still shares the GIL with the loop, so
a small pool also bounds how much of it the loop loses (CPython hands the GIL over every 5 ms).
Small inputs are handled inline (`run_cpu_if`): a thread hop costs more than the work.

Two things hold the GIL for seconds whatever the pool does, and so stop the loop too:
the tokenizer backend's `encode` (models/tokenizer.py encodes long texts with the GIL
released instead), and CPython's full garbage collections, which a burst of allocation
(validating 60,000 messages makes ~10^6 objects) triggers and which walk every tracked
object in the process (the model, jax, the app: ~0.5-0.9 s each here). `freeze_heap()`,
called once the engine is up, moves the long-lived objects out of the collector's sight
(`gc.freeze`), so a collection walks only what requests allocated since.

Start-up pauses the collector (`pause_collector`, `ferrox serve` before its imports) until
the weights are placed (`resume_collector`): the imports, the GGUF's vocabulary and the
tokenizer allocate ~10^6 long-lived objects, and each full collection they triggered walked
all of them (0.4-1.3 s of a restart's CPU at load 6-16, docs/benchmarks.md). Resuming
freezes what start-up made so far, so the warm-up's collections skip it too, and
`freeze_heap` collects it all once, before serving, as it did already.

The pool and the collector belong to the process, not to one app: `create_app` hands this
module its two settings (`configure`: `ServerConfig.cpu_workers` and `gc_freeze`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DEFAULT_WORKERS = 2
INLINE_BODY_BYTES = 64 << 10  # bodies up to this are validated on the loop (well under 1 ms)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()  # guards the pool and the two settings below
_cpu_workers = DEFAULT_WORKERS
_gc_freeze = True
_paused = False  # `pause_collector` turned automatic collections off, `resume_collector` not yet on


def configure(*, cpu_workers: int = DEFAULT_WORKERS, gc_freeze: bool = True) -> None:
    """The process's settings (`ServerConfig.cpu_workers` and `gc_freeze`; `create_app`
    calls this). A pool made with another size is replaced; what runs on it finishes."""
    global _pool, _cpu_workers, _gc_freeze
    with _pool_lock:
        _gc_freeze = gc_freeze
        if cpu_workers != _cpu_workers:
            _cpu_workers = cpu_workers
            if _pool is not None:
                _pool.shutdown(wait=False)
                _pool = None


def cpu_pool() -> ThreadPoolExecutor:
    """The process's pool for CPU-heavy request steps (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_cpu_workers, thread_name_prefix="ferrox-cpu")
        return _pool


async def run_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the CPU pool; its exception re-raises here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(cpu_pool(), functools.partial(fn, *args, **kwargs))


async def run_cpu_if(heavy: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`run_cpu` when `heavy`, else a plain call on the loop."""
    if heavy:
        return await run_cpu(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def parse_body_off_loop(raw: bytes, model: Any) -> Any:
    """`api.protocol.parse_body(raw, model)`, in the pool for a body over INLINE_BODY_BYTES."""
    from api.protocol import parse_body

    return await run_cpu_if(len(raw) > INLINE_BODY_BYTES, parse_body, raw, model)


def freeze_heap(collect: bool = True) -> int:
    """Freeze what is alive now (the loaded model, modules, the app) so later full collections
    skip it; returns the number of objects frozen. Off with `--no-gc-freeze` (FERROX_GC_FREEZE=0).

    The earlier freeze is undone first, so after a model swap (`/admin/models/load` calls
    this too) the old engine's objects are collectable again. `collect` runs a full
    collection first so no garbage is frozen with the rest (~0.5 s holding the GIL: the
    start-up loader thread does it once, before serving; a swap, which happens while
    serving, and a server started over an engine already built, skip it).
    """
    if not _gc_freeze:
        gc.unfreeze()  # start-up's own freeze (`resume_collector`): its garbage collectable again
        return 0
    gc.unfreeze()
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def pause_collector() -> None:
    """No automatic collections from here until `resume_collector` (module docstring); nothing
    where the collector is off already (then it is not this module's to turn on)."""
    global _paused
    with _pool_lock:
        if gc.isenabled():
            gc.disable()
            _paused = True


def resume_collector(freeze: bool = True) -> None:
    """Automatic collections back on after `pause_collector` (nothing without a pause).
    `freeze`: what is alive now, start-up's garbage included, is frozen first, so collections
    until `freeze_heap` walk only what comes after (`freeze_heap` unfreezes and collects it).
    A failed start passes False: the half-built model must stay collectable (api/app.py)."""
    global _paused
    with _pool_lock:
        if not _paused:
            return
        _paused = False
        if freeze:
            gc.freeze()
        gc.enable()
