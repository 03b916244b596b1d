"""A GGUF file's metadata, read one way by everything that reads it.

A GGUF file describes itself in key/value metadata: `general.*` (its architecture, its
type: a model or a LoRA adapter), `{arch}.*` (the model's config, read by
`models/loaders/gguf.py` and each family's `config_from_gguf`), `tokenizer.*` (the
vocabulary, rebuilt by `models/gguf_vocab.py` for `models/tokenizer.py`) and `adapter.*`
(`models/lora_gguf.py`). `GGUFMetadata` reads those keys from an open GGUF file (`models/gguf_reader.py`'s
`GGUFFile` or a `gguf.GGUFReader`: the same `fields` and `tensors`) or from a plain `{key: value}` dict (a vocabulary given without a file), and knows the
file's tensor names; the few non-parameter tensors a config is made of (RoPE factors)
are read through the loader's dequantizer, handed in, so this module imports neither
`gguf` nor numpy and the tokenizer can use it without them.
"""

from __future__ import annotations

from typing import Any, Callable


class GGUFMetadata:
    """Uniform access to GGUF metadata keys, from an open GGUF file or from a plain dict.

    Args:
      source: a `GGUFFile` or `gguf.GGUFReader` (keys from its `fields`, tensors from its `tensors`) or
        a `{key: value}` mapping (keys only).
      dequantize: the loader's reader-tensor -> f32 array function; `tensor` needs it.
    """

    def __init__(self, source: Any, dequantize: Callable[[Any], Any] | None = None) -> None:
        self._fields = getattr(source, "fields", None)
        self._dict = None if self._fields is not None else dict(source)
        self._tensors = {t.name: t for t in getattr(source, "tensors", ())}
        self._dequantize = dequantize

    @property
    def arch(self) -> str | None:
        """`general.architecture`: the family's GGUF name ("llama", "qwen3", ...)."""
        return self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        """The key's value (a scalar, a string or a list), or `default` when absent."""
        if self._dict is not None:
            return self._dict.get(key, default)
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str, purpose: str = "") -> Any:
        """The key's value; ValueError naming the key (and what it was needed for) when absent."""
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata has no {key!r}" + (f"; {purpose}" if purpose else ""))
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape in numpy order (ggml's dims reversed) without reading it; None when absent."""
        found = self._tensors.get(name)
        return None if found is None else tuple(int(d) for d in reversed(list(found.shape)))

    def tensor(self, name: str) -> Any:
        """A tensor dequantized to f32 (numpy order), or None when the file has none."""
        found = self._tensors.get(name)
        if found is None:
            return None
        if self._dequantize is None:
            raise ValueError(f"GGUF tensor {name!r} asked of metadata read without a dequantizer")
        return self._dequantize(found)
