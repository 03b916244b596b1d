"""models/gguf_reader.py: the struct reader of a GGUF file against the gguf package's GGUFReader.

Every GGUF the tests write (the loader's tiny llama in its quantization mix, tied and not,
one from a tiny HF checkpoint as llama.cpp's converter writes it, one with every metadata
value type and a custom alignment) and the shipped SmolLM2 file read the same keys, types,
values, tensor infos and tensor bytes both ways. A malformed or truncated file is refused
with a ValueError naming the file and what is wrong, never a crash or a hang; a comparison
that misses a wrong value is caught by the negative control. Last, the loader's open and
build share one trace of the abstract model (`models/loaders/common.py`) and leave it abstract.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models.gguf_reader import GGUFFile
from models.loaders.gguf import default_model_path, open_gguf
from tests.models.test_gguf_loader import write_tiny_gguf


def differences(ours, theirs) -> list[str]:
    """Every way `ours` (a GGUFFile) reads differently from `theirs` (a GGUFReader)."""
    out = []
    if list(ours.fields) != list(theirs.fields):
        out.append(f"keys {sorted(set(ours.fields) ^ set(theirs.fields))}")
    for key, field in theirs.fields.items():
        mine = ours.fields.get(key)
        if mine is None:
            continue
        if mine.types != field.types:
            out.append(f"{key}: types {mine.types} vs {field.types}")
        if mine.contents() != field.contents() or len(mine.data) != len(field.data):
            out.append(f"{key}: value differs")
        elif field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data):
            if mine.contents(0) != field.contents(0) or mine.contents(slice(-2, None)) != field.contents(slice(-2, None)):
                out.append(f"{key}: an element or a slice differs")
    if len(ours.tensors) != len(theirs.tensors):
        out.append(f"{len(ours.tensors)} tensors vs {len(theirs.tensors)}")
    for a, b in zip(ours.tensors, theirs.tensors):
        same = ((a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset)
                == (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset))
        same = same and a.shape.dtype == b.shape.dtype and np.array_equal(a.shape, b.shape)
        same = same and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        if not same or not np.array_equal(a.data, b.data):
            out.append(f"tensor {b.name} differs")
    if ours.alignment != theirs.alignment or ours.data_offset != theirs.data_offset:
        out.append("alignment or data offset differs")
    return out


def _every_value_type(path) -> None:
    """A GGUF with one key of each metadata value type, arrays of each, a
    non-default alignment and tensors of several types (elements and blocks)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    scalars = {"u8": (w.add_uint8, 7), "i8": (w.add_int8, -7), "u16": (w.add_uint16, 65000),
               "i16": (w.add_int16, -300), "u32": (w.add_uint32, 4_000_000_000), "i32": (w.add_int32, -5),
               "f32": (w.add_float32, 1e-5), "u64": (w.add_uint64, 2**60), "i64": (w.add_int64, -2**60),
               "f64": (w.add_float64, 0.1), "bool": (w.add_bool, True), "str": (w.add_string, "héllo ✓")}
    for name, (add, value) in scalars.items():
        add(f"test.{name}", value)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1e-5, -3.25])
    w.add_array("test.bools", [True, False])
    w.add_array("test.strings", ["a", "", "ü b", "Ġthe"])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    raw = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", raw, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _from_hf(tmp_path):
    from tests.support.gguf_from_hf import write_gguf
    from tests.support.tiny_model import make_tiny_checkpoint

    return write_gguf(make_tiny_checkpoint(tmp_path / "hf"), tmp_path / "from-hf.gguf", "llama")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reader")
    write_tiny_gguf(tmp / "tiny.gguf")
    write_tiny_gguf(tmp / "tied.gguf", tied=True)
    _every_value_type(tmp / "types.gguf")
    return {"tiny": tmp / "tiny.gguf", "tied": tmp / "tied.gguf", "types": tmp / "types.gguf",
            "from-hf": _from_hf(tmp)}


@pytest.mark.parametrize("name", ["tiny", "tied", "types", "from-hf", "shipped"])
def test_reads_what_ggufs_own_reader_reads(written, name):
    path = default_model_path() if name == "shipped" else written[name]
    ours = open_gguf(path)
    assert isinstance(ours, GGUFFile)
    assert differences(ours, gguf.GGUFReader(str(path))) == []
    if name == "types":  # the values themselves, not only agreement
        assert ours.alignment == 64 and ours.data_offset % 64 == 0
        f = ours.fields
        assert f["test.str"].contents() == "héllo ✓" and f["test.i64"].contents() == -2**60
        assert f["test.strings"].contents() == ["a", "", "ü b", "Ġthe"] and f["test.strings"].contents(2) == "ü b"
        assert len(f["test.ints"].data) == 3 and len(f["test.u8"].data) == 1
        assert f["test.f32"].contents() == float(np.float32(1e-5)) and f["test.bool"].contents() is True


def test_the_comparison_catches_a_wrong_reading(written, monkeypatch):
    """Negative control: a reader that drops a string array's last entry, or shifts a tensor's
    offset, is reported."""
    path = written["types"]
    theirs = gguf.GGUFReader(str(path))
    ours = GGUFFile(path)
    ours.fields["test.strings"].value = ours.fields["test.strings"].value[:-1]
    assert any("test.strings" in d for d in differences(ours, theirs))
    ours = GGUFFile(path)
    t = ours.tensors[0]
    ours.tensors[0] = t._replace(data_offset=t.data_offset + 4, data=ours.data[t.data_offset + 4:][:t.data.size * 4]
                                 .view(np.float32).reshape(t.data.shape))
    assert differences(ours, theirs) == [f"tensor {t.name} differs"]


def _mutations(blob: bytes) -> dict[str, bytes]:
    head = len(b"GGUF") + 4 + 8 + 8  # magic, version, tensor count, metadata count
    first_key = head + 8  # where the first key's bytes start
    return {
        "empty": b"",
        "bad magic": b"GGUX" + blob[4:],
        "big-endian": blob[:4] + (3).to_bytes(4, "big") + blob[8:],
        "version 9": blob[:4] + (9).to_bytes(4, "little") + blob[8:],
        "huge metadata count": blob[:16] + (2**62).to_bytes(8, "little") + blob[24:],
        "huge key length": blob[:head] + (2**40).to_bytes(8, "little") + blob[head + 8:],
        "key not UTF-8": blob[:first_key] + b"\xff" + blob[first_key + 1:],
        "unknown value type": _retype_first_value(blob, 99),
    }


def _retype_first_value(blob: bytes, kind: int) -> bytes:
    head = len(b"GGUF") + 4 + 8 + 8
    key_len = int.from_bytes(blob[head:head + 8], "little")
    at = head + 8 + key_len
    return blob[:at] + kind.to_bytes(4, "little") + blob[at + 4:]


@pytest.mark.parametrize("case", ["empty", "bad magic", "big-endian", "version 9", "huge metadata count",
                                  "huge key length", "key not UTF-8", "unknown value type"])
def test_a_malformed_file_is_refused_with_a_clear_error(written, tmp_path, case):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_mutations(written["tiny"].read_bytes())[case])
    with pytest.raises(ValueError, match=r"bad\.gguf is not a valid GGUF file") as e:
        open_gguf(bad)
    assert "Error" not in str(e.value), str(e.value)  # says what is wrong, in words


@pytest.mark.parametrize("keep", [5, 30, 300, 3000, 0.5, 0.97])
def test_a_truncated_file_is_refused_wherever_it_stops(written, tmp_path, keep):
    """Cut inside the header, a key, the vocabulary strings, the tensor infos and the data."""
    blob = written["types"].read_bytes() if keep in (5, 30, 300) else written["tiny"].read_bytes()
    cut = keep if isinstance(keep, int) else int(len(blob) * keep)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(blob[:cut])
    with pytest.raises(ValueError, match=r"cut\.gguf is not a valid GGUF file .*(truncated|magic)") as e:
        open_gguf(bad)
    assert "Error" not in str(e.value), str(e.value)


# -- the one trace an open and a build share (models/loaders/common.py) -------------------------


def _cached_leaves(cfg):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.loaders.common import _traced

    _, state = _traced(cfg, jnp.dtype(jnp.float32))
    return [leaf.get_value() for _, leaf in nnx.to_flat_state(state)], jax.ShapeDtypeStruct


def test_opening_and_building_a_gguf_traces_the_model_once_and_keeps_the_trace_abstract(written):
    from models.loader import open_checkpoint
    from models.loaders.common import _traced

    _traced.cache_clear()
    source = open_checkpoint(written["tiny"])
    model = source.build()
    assert _traced.cache_info().misses == 1, _traced.cache_info()  # the tables and the build: one trace
    leaves, abstract = _cached_leaves(source.config)
    assert leaves and all(isinstance(v, abstract) for v in leaves), "building filled the cached trace"
    assert not isinstance(model.embed.get_value(), abstract)


def test_the_abstract_check_catches_a_model_merged_without_a_copy(written):
    """Negative control: filling a model merged from the cached trace without copying
    (nnx.merge's default) writes into the cache, and the check above sees it."""
    import jax.numpy as jnp
    from flax import nnx

    from models.loader import open_checkpoint
    from models.loaders.common import _traced

    _traced.cache_clear()
    cfg = open_checkpoint(written["tiny"]).config
    graphdef, state = _traced(cfg, jnp.dtype(jnp.float32))
    shared = nnx.merge(graphdef, state)
    shared.embed.set_value(jnp.zeros(shared.embed.get_value().shape))
    leaves, abstract = _cached_leaves(cfg)
    assert not all(isinstance(v, abstract) for v in leaves)
    _traced.cache_clear()  # the cache is now wrong: the next caller traces again
