"""GGUF vocabularies rebuilt as `tokenizers` backends (the `tokenizer.ggml.*` metadata).

Two kinds (`tokenizer.ggml.model`):

    "gpt2"   byte-level BPE: tokens are already spelled in GPT-2's byte alphabet ("Ġt"),
             merges are stored; the split regex depends on `tokenizer.ggml.pre`.
    "llama"  SentencePiece BPE: tokens use "▁" for spaces, unknown bytes fall back to
             "<0xXX>" tokens, merges are derived from the tokens' scores.
    "gemma4" Gemma 4's vocabulary as llama.cpp's converter writes it: SentencePiece-style
             tokens ("▁" for spaces, "<0xXX>" byte fallback) with the tokenizer's own BPE
             merges, no space prefix, BOS added. Spaces become "▁" before anything else;
             the text is split only into newline runs and the rest (no word-level split:
             merges run over a whole line, spaces and all); a newline run the vocabulary
             holds is that one token (llama.cpp's rule for gemma4; transformers makes such
             a SentencePiece user-defined piece an added token, matched whole); every other
             piece is merged by rank over its characters, a character without a token
             falling back to its UTF-8 bytes. This is what HF's Gemma tokenizer computes
             (checked on the converter's own Gemma 4 vocabulary against the ids HF gave
             for llama.cpp's test texts, docs/models.md).

Token types (llama.cpp's enum): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control and unknown tokens become special tokens (one id each, dropped by
`decode(skip_special_tokens=True)`); user-defined ones become plain added tokens (one id
each, kept on decode), as transformers does. `models/tokenizer.py` wraps the result; the
keys are read through `models/gguf_metadata.py`.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from models.config import UnsupportedModelError
from models.gguf_metadata import GGUFMetadata

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


def gguf_backend(meta: GGUFMetadata) -> tuple[BackendTokenizer, bool]:
    """The backend for a GGUF vocabulary and whether BOS is added by default (llama.cpp's
    defaults: on for SentencePiece and the llama3 pre-tokenizer, off for other byte-level BPE).

    Raises:
      UnsupportedModelError: a vocabulary kind or pre-tokenizer we cannot reproduce faithfully.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens", "cannot build the tokenizer"))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        backend = _byte_level_backend(tokens, token_types, list(meta.get("tokenizer.ggml.merges") or []), pre)
        return backend, pre in _LLAMA3_PRES
    if kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
        backend = _sentencepiece_backend(
            tokens, token_types, scores, meta.get("tokenizer.ggml.merges"),
            meta.get("tokenizer.ggml.unknown_token_id"), True if add_space_prefix is None else bool(add_space_prefix),
        )
        return backend, True
    if kind == "gemma4":
        merges = meta.require("tokenizer.ggml.merges", "cannot build the gemma4 tokenizer (its BPE merges)")
        backend = _gemma4_backend(tokens, token_types, list(merges), meta.get("tokenizer.ggml.unknown_token_id"))
        return backend, True  # and BOS whatever the file says (models/tokenizer.py, as llama.cpp)
    raise UnsupportedModelError(
        f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
        "'llama' (SentencePiece BPE), 'gemma4' (SentencePiece-style tokens with BPE merges)"
    )


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


def _gemma4_backend(tokens: list[str], token_types: list[int], merges: list[str],
                    unk_id: int | None) -> BackendTokenizer:
    """Gemma 4's vocabulary (module docstring): "▁" for spaces, newline runs split off, BPE
    by the file's merge ranks with byte fallback, no space prefix. A merge is cut at its first
    space after the first character, as llama.cpp reads it (a token may begin with a space)."""
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(token_types) if t == TOKEN_TYPE_UNKNOWN), None)
    vocab = _vocab(tokens)
    backend = BackendTokenizer(BPE(
        vocab=vocab, merges=[(m[:cut], m[cut + 1:]) for m in merges if (cut := m.find(" ", 1)) > 0],
        unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True, byte_fallback=True,
    ))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_typed_tokens(backend, tokens, token_types, None)
    # A newline run the vocabulary holds is one token (llama.cpp's gemma4 rule), whatever
    # merges the file has for it: added tokens, matched longest first, before any merge.
    runs = [t for t in tokens if t and set(t) == {"\n"}]
    if runs:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in runs])
    return backend


def set_bos_eos_post_processor(backend: BackendTokenizer, tokens: Sequence[str],
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
