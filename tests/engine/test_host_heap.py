"""ferrox_jax/host_heap.py: the heap's freed pages go back to the system after warm-up."""

from __future__ import annotations

import os

import pytest

from ferrox_jax.host_heap import trim_host_heap


def test_trimming_the_host_heap_gives_freed_pages_back():
    """Many small blocks freed in the heap stay resident until trimmed (the negative control
    is the resident set before the trim)."""
    import ctypes

    if not trim_host_heap():
        pytest.skip("no glibc malloc_trim here")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [ctypes.create_string_buffer(1000) for _ in range(200_000)]  # ~200 MB of small mallocs
    keep = blocks[::2000]  # a few live blocks pin the heap's top: free() alone cannot shrink it
    del blocks
    before = rss()
    assert trim_host_heap()
    assert rss() < before - 50 * (1 << 20), f"trim gave back {(before - rss()) >> 20} MiB"
    del keep
