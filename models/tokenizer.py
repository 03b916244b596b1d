"""Tokenizer: text <-> token ids, stop tokens, and the chat template, for one checkpoint.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) built either from an HF
folder's `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` metadata, and renders
the checkpoint's chat template in a sandboxed jinja2 environment. The engine only needs
`encode`, `decode`, `stop_token_ids` and `apply_chat_template`; nothing here imports jax
or transformers (the latter is a dev-only dependency the tests compare against).

Whether BOS is prepended follows the checkpoint: the `tokenizer.json` post-processor for
HF folders, `tokenizer.ggml.add_bos_token` for GGUF (defaulting as llama.cpp does: on
for SentencePiece vocabularies and the llama3 pre-tokenizer, off for other byte-level BPE).

GGUF vocabularies come in two kinds we rebuild (`tokenizer.ggml.model`):

    "gpt2"   byte-level BPE: tokens are already spelled in GPT-2's byte alphabet ("Ġt"),
             merges are stored; the split regex depends on `tokenizer.ggml.pre`.
    "llama"  SentencePiece BPE: tokens use "▁" for spaces, unknown bytes fall back to
             "<0xXX>" tokens, merges are derived from the tokens' scores.

Token types (llama.cpp's enum): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control and unknown tokens become special tokens (one id each, dropped by
`decode(skip_special_tokens=True)`); user-defined ones become plain added tokens (one id
each, kept on decode), as transformers does.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from models.config import UnsupportedModelError

# End-of-turn / end-of-text tokens chat templates close a turn with. Each one present in
# the vocabulary as a special token is a stop token, next to the checkpoint's eos.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
    "</s>", "<|end|>", "<end_of_turn>", "<|END_OF_TURN_TOKEN|>",
)

# Used when a checkpoint has no chat template: "role: content" paragraphs, then an open
# "assistant:" turn when a generation prompt is asked for. Plain text on purpose, so it
# works for any vocabulary (base models have no chat tokens).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 2, 3, 4

# Split regexes for byte-level vocabularies, keyed by `tokenizer.ggml.pre`; each is the
# one llama.cpp uses for that pre-tokenizer (llama-vocab.cpp) and the one the original
# tokenizer.json applies. None: GPT-2's own regex inside the ByteLevel pre-tokenizer.
_GPT2_DIGITS = "gpt2+digits"  # GPT-2 regex after splitting every digit apart (StarCoder family)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": _GPT2_DIGITS, "starcoder": _GPT2_DIGITS, "refact": _GPT2_DIGITS,
    "codeshell": _GPT2_DIGITS, "command-r": _GPT2_DIGITS,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp sets ignore_merges for the llama3 pre-tokenizer (a word already in the
# vocabulary is one token), and its tokenizer.json says the same; it also adds BOS.
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (including sandbox violations)."""


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
        self._compiled_template: jinja2.Template | None = None
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
        """Token ids of `text`; `add_special_tokens` applies the post-processor (BOS/EOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- chat template -----------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the checkpoint's template (or FALLBACK_CHAT_TEMPLATE).

        The template sees `messages` (keys whose value is None dropped, as transformers
        does), `add_generation_prompt`, `tools=None`, `documents=None` and the special token
        strings `bos_token`, `eos_token`, `unk_token`, `pad_token`.
        Raises ChatTemplateError when the template does not compile, raises itself
        (`raise_exception`), touches something the sandbox forbids, or fails while rendering.
        """
        template = self._template()
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("chat messages must be dicts with 'role' and 'content'")
        clean = [_plain_data({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special_token_strings(),
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from e

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            source = self.chat_template if self.chat_template is not None else FALLBACK_CHAT_TEMPLATE
            try:
                self._compiled_template = _chat_environment().from_string(source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e
        return self._compiled_template

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
        backend = BackendTokenizer.from_file(tokenizer_file)
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
            chat_template=_hf_chat_template(path, config),
            extra_stop_token_ids=gen_eos_ids,
        )

    @classmethod
    def from_gguf(cls, reader_or_metadata: Any) -> "Tokenizer":
        """Build from a `gguf.GGUFReader` or a `{key: value}` dict of its metadata.

        Raises UnsupportedModelError for a vocabulary kind or byte-level pre-tokenizer
        we cannot reproduce faithfully.
        """
        meta = _TokenizerMetadata(reader_or_metadata)
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
        token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre") or "default"
            backend = _byte_level_backend(tokens, token_types, list(meta.get("tokenizer.ggml.merges") or []), pre)
            default_add_bos = pre in _LLAMA3_PRES
        elif kind == "llama":
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
            backend = _sentencepiece_backend(
                tokens, token_types, scores, meta.get("tokenizer.ggml.merges"),
                meta.get("tokenizer.ggml.unknown_token_id"), True if add_space_prefix is None else bool(add_space_prefix),
            )
            default_add_bos = True
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE)"
            )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_bos = default_add_bos if add_bos is None else bool(add_bos)
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token") or False)
        _set_bos_eos_post_processor(backend, tokens, bos if add_bos else None, eos if add_eos else None)
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


# -- chat template environment ---------------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # As transformers: jinja's own tojson HTML-escapes, which would corrupt tool schemas.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, closing a route to CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (minus its generation tracker)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain_data(value: Any) -> Any:
    """Rebuild messages out of plain JSON types so the template sees no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(v) for v in value]
    # Subclasses (str enums, numpy scalars' kin) carry extra methods: strip to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


# -- HF folder helpers -----------------------------------------------------------------


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(path: str, config: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# -- GGUF helpers ----------------------------------------------------------------------


class _TokenizerMetadata:
    """Uniform access to GGUF metadata from a GGUFReader or from a plain dict."""

    def __init__(self, source: Any):
        self._fields = getattr(source, "fields", None)
        self._dict = None if self._fields is not None else dict(source)

    def get(self, key: str) -> Any:
        if self._dict is not None:
            return self._dict.get(key)
        field = self._fields.get(key)
        return None if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata has no {key!r}; cannot build the tokenizer")
        return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level tokens are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # first id wins for the rare duplicate spelling
    return vocab


def _add_typed_tokens(backend: BackendTokenizer, tokens: Sequence[str], token_types: Sequence[int],
                      alphabet: set[str] | None) -> None:
    """Control/unknown tokens as special, user-defined as plain added tokens (one id each).

    In a byte-level vocabulary every real token is spelled in the byte alphabet; a token
    marked control that is not is a conversion mislabel and is left alone (as transformers does).
    """
    special, user = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            if alphabet is None or set(token) <= alphabet:
                special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _byte_level_backend(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> BackendTokenizer:
    if pre not in BYTE_LEVEL_SPLITS:
        raise UnsupportedModelError(
            f"GGUF byte-level pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(sorted(BYTE_LEVEL_SPLITS))}"
        )
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (rare, mislabelled specials) are respelled byte by byte.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(BPE(
        vocab=_vocab(spelled), merges=pairs, fuse_unk=False,
        ignore_merges=pre in _LLAMA3_PRES,
    ))
    split = BYTE_LEVEL_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _GPT2_DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, token_types, alphabet)
    return backend


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-greedy merging.

    Every split of a token into two in-vocabulary pieces is a merge ranked by the merged
    token's score (higher first); ties go to the longer left, then longer right piece, then
    to the pieces' ids (transformers' `generate_merges` order).
    """
    vocab = _vocab(tokens)
    ranked = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, left, right) for left, right in local)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_backend(tokens: list[str], token_types: list[int], scores: list[float],
                           merges: list[str] | None, unk_id: int | None, add_space_prefix: bool) -> BackendTokenizer:
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else sentencepiece_merges(tokens, scores)
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(token_types) if t == TOKEN_TYPE_UNKNOWN), None)
    backend = BackendTokenizer(BPE(
        vocab=_vocab(tokens), merges=pairs, unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))
    # As llama.cpp: spaces become "▁", and each text fragment (the start, and the text
    # after every special token) gets a leading "▁" when add_space_prefix is set. The
    # normalizer runs per fragment between added tokens, which gives exactly that.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    _add_typed_tokens(backend, tokens, token_types, None)
    return backend


def _set_bos_eos_post_processor(backend: BackendTokenizer, tokens: Sequence[str],
                                bos_id: int | None, eos_id: int | None) -> None:
    """Prepend BOS / append EOS on `encode(add_special_tokens=True)`, as the GGUF asks."""
    if bos_id is None and eos_id is None:
        return
    head = f"{tokens[bos_id]}:0 " if bos_id is not None else ""
    tail = f" {tokens[eos_id]}:0" if eos_id is not None else ""
    tail_b = f" {tokens[eos_id]}:1" if eos_id is not None else ""
    head_b = f"{tokens[bos_id]}:1 " if bos_id is not None else ""
    specials = {(tokens[i], i) for i in (bos_id, eos_id) if i is not None}
    backend.post_processor = processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head_b}$B:1{tail_b}",
        special_tokens=sorted(specials),
    )
