"""What a GGUF costs in host memory once served: the file's mapped pages are given back after
the weights are placed (`models/loaders/gguf.py:release_pages`), and a quantized embedding is
kept as its blocks rather than a float32 table (`models/quant.py:embed_lookup`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from models.gguf_blocks import BlockQuantizedWeight
from models.loader import open_checkpoint
from models.loaders.gguf import open_gguf, release_pages
from tests.models.test_gguf_loader import write_tiny_gguf

MIB = 1 << 20


def mapped_rss_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            words = line.split()
            if "-" in words[0] and len(words) >= 5 and ":" not in words[0]:  # a mapping's header line
                inside = len(words) >= 6 and words[-1] == str(path)
            elif inside and words[0] == "Rss:":
                total += int(words[1]) * 1024
    return total


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    """A tiny model with a wide float32 embedding: a few MiB of pages to see come and go."""
    path = tmp_path_factory.mktemp("mem") / "wide.gguf"
    write_tiny_gguf(path, tied=True)
    return path


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_reading_the_weights_maps_pages_and_release_gives_them_back(big_gguf):
    reader = open_gguf(big_gguf)
    before = mapped_rss_bytes(big_gguf)
    touched = sum(float(np.asarray(t.data).astype(np.float64).sum()) for t in reader.tensors)
    assert np.isfinite(touched)
    read = mapped_rss_bytes(big_gguf)
    assert read > before, f"reading every tensor makes the file resident ({before} -> {read} bytes)"
    release_pages(reader)
    assert mapped_rss_bytes(big_gguf) < read, "released: the file's pages leave the resident set"
    assert float(np.asarray(reader.tensors[0].data).astype(np.float64).sum()) is not None, "still readable"


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_build_gives_the_files_pages_back(big_gguf):
    source = open_checkpoint(str(big_gguf))
    model = source.build(quantization="gguf")
    held = mapped_rss_bytes(big_gguf)
    # Negative control: the same reads without the release keep the pages.
    dataclasses.replace(source, release=None).build(quantization="gguf")
    kept = mapped_rss_bytes(big_gguf)
    assert held < kept, f"after a build the file's pages are given back ({held} vs {kept} bytes kept without)"
    source.release()
    assert isinstance(model.embed.get_value(), BlockQuantizedWeight), "the Q8_0 embedding stays as blocks"


def test_the_fast_reader_reads_what_ggufs_own_reader_reads(big_gguf):
    """`open_gguf`'s reader (`models/gguf_reader.py`) reads the same fields, values, types
    and tensors as gguf.GGUFReader (tests/models/test_gguf_reader.py: every written GGUF)."""
    from gguf import GGUFReader

    ours, theirs = open_gguf(big_gguf), GGUFReader(str(big_gguf))
    assert type(ours) is not GGUFReader and list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and mine.contents() == field.contents(), key
        assert len(mine.data) == len(field.data), key
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        np.testing.assert_array_equal(a.data, b.data)
