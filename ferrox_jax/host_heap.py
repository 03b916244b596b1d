"""The host heap after start-up: what compiling leaves behind is given back before serving.

`Engine.warmup` calls `trim_host_heap` once every step shape is compiled. No jax here.
"""

from __future__ import annotations


def trim_host_heap() -> bool:
    """Hand the host heap's free pages back to the system (glibc's `malloc_trim(0)`); True
    when it ran. Compiling the step shapes leaves LLVM's freed memory in malloc's arenas:
    on Llama 3.2 1B's shape (23 shapes, cold) it gave back 0.18 GiB of resident memory, 0.05
    GiB after a start from the compile cache. Elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return False
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
