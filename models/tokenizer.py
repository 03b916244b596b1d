"""Tokenizer: text <-> token ids, stop tokens, and the chat template, for one checkpoint.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) built either from an HF
folder's `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` metadata
(`models/gguf_vocab.py` rebuilds those vocabularies), and renders the checkpoint's chat
template (`models/chat_template.py`, sandboxed). The engine only needs `encode`,
`decode`, `stop_token_ids` and `apply_chat_template`; nothing here imports jax or
transformers (the latter is a dev-only dependency the tests compare against).

Whether BOS is prepended follows the checkpoint: the `tokenizer.json` post-processor for
HF folders, `tokenizer.ggml.add_bos_token` for GGUF (defaulting as llama.cpp does: on
for SentencePiece vocabularies and the llama3 pre-tokenizer, off for other byte-level BPE;
always on for Gemma 4's "gemma4" vocabulary, which llama.cpp forces on whatever the file says).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from models.chat_template import FALLBACK_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, hf_chat_template
from models.config import CheckpointFileError, read_json_file
from models.gguf_metadata import GGUFMetadata
from models.gguf_vocab import gguf_backend, set_bos_eos_post_processor

__all__ = ["END_OF_TURN_TOKENS", "FALLBACK_CHAT_TEMPLATE", "ChatTemplateError", "Tokenizer"]

# End-of-turn / end-of-text tokens chat templates close a turn with. Each one present in
# the vocabulary as a special token is a stop token, next to the checkpoint's eos.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
    "</s>", "<|end|>", "<end_of_turn>", "<|END_OF_TURN_TOKEN|>",
)

GIL_FREE_ENCODE_CHARS = 16 << 10  # longer texts are encoded with the GIL released (`Tokenizer.encode`)


class Tokenizer:
    """A checkpoint's tokenizer: the backend plus special ids and the chat template.

    Build with `from_hf_dir` or `from_gguf`; the constructor takes the pieces directly.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self._compiled_template: ChatTemplate | None = None
        special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        stop = {i for i in extra_stop_token_ids if i is not None}
        if eos_token_id is not None:
            stop.add(eos_token_id)
        for token in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None and token_id in special_ids:
                stop.add(token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stop)

    # -- text <-> ids ------------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (BOS/EOS).

        A long text goes through `encode_batch`, the same ids: the backend's `encode` holds
        the GIL for the whole call (measured: 5.9 s for the 2.4 M characters a 60,000-message
        chat renders to, every other thread and the server's event loop stopped), while
        `encode_batch` releases it while the Rust code runs.
        """
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- chat template -----------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """Render `messages` with the checkpoint's template (or FALLBACK_CHAT_TEMPLATE).

        The template sees `messages`, `add_generation_prompt`, `tools`, `documents=None` and
        the special token strings `bos_token`, `eos_token`, `unk_token`, `pad_token`, and
        `template_kwargs` as further variables (a request's `chat_template_kwargs`).
        Raises ChatTemplateError when the template does not compile, raises itself
        (`raise_exception`), touches something the sandbox forbids, or fails while rendering.
        """
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template)
        return self._compiled_template.render(messages, add_generation_prompt=add_generation_prompt,
                                              special_tokens=self._special_token_strings(), tools=tools,
                                              extra=template_kwargs)

    def _special_token_strings(self) -> dict[str, str]:
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "unk_token": self.unk_token_id, "pad_token": self.pad_token_id}
        return {name: self._backend.id_to_token(i) for name, i in names.items() if i is not None}

    # -- constructors ------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load `tokenizer.json` plus `tokenizer_config.json`, `chat_template.jinja` and
        `generation_config.json` when present. BOS/EOS insertion is whatever the
        tokenizer.json post-processor does. `chat_template.jinja` wins over the config's
        `chat_template` (as in transformers); a list of named templates uses "default".
        """
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = BackendTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the Rust library raises a bare Exception whose text names no file
            raise CheckpointFileError(f"{tokenizer_file} cannot be read as a tokenizer ({e}); "
                                      "copy the checkpoint again") from None
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        eos = token_id("eos_token")
        if eos is None and gen_eos_ids:
            eos = gen_eos_ids[0]
        bos = token_id("bos_token")
        if bos is None:
            bos = generation.get("bos_token_id")
        pad = token_id("pad_token")
        if pad is None:
            pad = generation.get("pad_token_id")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            unk_token_id=token_id("unk_token"),
            chat_template=hf_chat_template(path, config),
            extra_stop_token_ids=gen_eos_ids,
        )

    @classmethod
    def from_gguf(cls, reader_or_metadata: Any) -> "Tokenizer":
        """Build from a `gguf.GGUFReader` or a `{key: value}` dict of its metadata.

        Raises UnsupportedModelError for a vocabulary kind or byte-level pre-tokenizer
        we cannot reproduce faithfully.
        """
        meta = GGUFMetadata(reader_or_metadata)
        tokens: list[str] = list(meta.require("tokenizer.ggml.tokens", "cannot build the tokenizer"))
        backend, default_add_bos = gguf_backend(meta)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_bos = default_add_bos if add_bos is None else bool(add_bos)
        if meta.get("tokenizer.ggml.model") == "gemma4":  # as llama.cpp: Gemma 4 needs its BOS whatever the file says
            add_bos = True
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token") or False)
        set_bos_eos_post_processor(backend, tokens, bos if add_bos else None, eos if add_eos else None)
        extra_stops = [meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_stop_token_ids=[i for i in extra_stops if i is not None],
        )


# -- HF folder helpers -----------------------------------------------------------------


def _read_json(path: str) -> dict:
    """An optional JSON file of the folder ({} when absent); a broken one is refused naming it."""
    if not os.path.isfile(path):
        return {}
    return read_json_file(path)


