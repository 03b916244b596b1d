"""`models/gguf_blocks.py:device_copy`, how a GGUF's blocks are placed: one host copy that
only the device array holds, never the caller's memory (a file's map or an array it writes).

The negative control is `jax.device_put` of the caller's array itself, what the copy exists
to avoid: on the CPU backend it adopts a 64-byte-aligned host array as the device array's
memory, so a later write to the host array shows through in the "placed" weights.
"""

from __future__ import annotations

import gc
import threading

import jax
import numpy as np

from models import gguf_blocks
from models.gguf_blocks import HOST_ALIGN, device_copy, make_weight


def aligned(nbytes: int, fill: int = 0) -> np.ndarray:
    """A writable u8[nbytes] whose data starts on a HOST_ALIGN boundary."""
    buf = np.empty(nbytes + HOST_ALIGN, np.uint8)
    start = -buf.ctypes.data % HOST_ALIGN
    out = buf[start:start + nbytes]
    out[:] = fill
    return out


def test_an_aligned_host_array_written_after_placing_leaves_the_placed_copy_as_it_was():
    host = aligned(4096, 7).reshape(64, 64)
    placed = device_copy(host)
    host[:] = 9  # the caller writes its array afterwards
    np.testing.assert_array_equal(np.asarray(placed), np.full((64, 64), 7, np.uint8))
    assert placed.dtype == np.uint8 and placed.shape == (64, 64)
    # Negative control: the caller's own aligned array handed to device_put is adopted, not copied.
    if jax.default_backend() == "cpu":
        host[:] = 7
        aliased = jax.device_put(host)
        host[:] = 9
        assert int(np.asarray(aliased)[0, 0]) == 9, "device_put adopts an aligned host array on CPU"


def test_a_mapped_file_is_copied_off_its_pages(tmp_path):
    path = tmp_path / "blocks.bin"
    data = np.arange(8192, dtype=np.uint32).view(np.uint8)
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, mode="r", offset=0)  # page-aligned: device_put would adopt the map
    placed = device_copy(mapped[:4096].reshape(32, 128))
    start, stop = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    if jax.default_backend() == "cpu":
        assert not start <= placed.unsafe_buffer_pointer() < stop, "the weights must not live in the file's map"
    del mapped
    gc.collect()
    np.testing.assert_array_equal(np.asarray(placed), data[:4096].reshape(32, 128))


def test_strided_blocks_and_an_expert_stack_place_as_their_values():
    rows = np.random.default_rng(0).integers(0, 256, (8, 36), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(device_copy(rows[::2])), rows[::2])  # not contiguous
    stack = np.random.default_rng(1).integers(0, 256, (3, 4, 18), dtype=np.uint8)
    weight = make_weight(stack, "q4_0", 32)
    np.testing.assert_array_equal(np.asarray(weight.blocks), stack)
    assert weight.shape == (3, 32, 4)
    host = rows.copy()
    weight = make_weight(host, "q4_0", 64)
    del host
    gc.collect()  # the placed array holds its own buffer, not the caller's
    np.testing.assert_array_equal(np.asarray(weight.blocks), rows)


def test_a_large_copy_is_split_over_the_copy_threads_and_places_every_row(monkeypatch):
    """Above PARALLEL_COPY_BYTES the copy goes by leading-row chunks to the copy pool; every
    row must land, a strided source and an expert stack included (a chunk bound off by one
    leaves a row of zeros or a row shifted)."""
    monkeypatch.setattr(gguf_blocks, "copy_threads", lambda: 3)
    calls = []
    real = np.copyto

    def recording(dst, src):
        calls.append((threading.current_thread().name, dst.shape[0]))
        real(dst, src)

    monkeypatch.setattr(gguf_blocks.np, "copyto", recording)
    big = np.random.default_rng(2).integers(0, 256, (2003, 4608), dtype=np.uint8)
    src = big[::2]  # 1002 rows, strided, 4.6 MB: over the threshold
    placed = device_copy(src)
    monkeypatch.setattr(gguf_blocks.np, "copyto", real)
    np.testing.assert_array_equal(np.asarray(placed), src)
    assert len(calls) == 12 and sum(rows for _, rows in calls) == 1002
    assert all(name.startswith("ferrox-copy") for name, _ in calls)
    stack = np.random.default_rng(3).integers(0, 256, (5, 1000, 1152), dtype=np.uint8)  # 5 experts, 5.8 MB
    dst = np.zeros_like(stack)
    gguf_blocks.parallel_copy(dst, stack)
    np.testing.assert_array_equal(dst, stack)
    small = rows_of(16)
    out = np.zeros_like(small)
    gguf_blocks.parallel_copy(out, small)  # under the threshold: the calling thread
    np.testing.assert_array_equal(out, small)


def rows_of(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, 64), dtype=np.uint8)
