"""Gemma 4's GGUF vocabulary (`tokenizer.ggml.model` "gemma4", `models/gguf_vocab.py`): the
same ids as HF's tokenizer of the checkpoint the file came from.

The checkpoint's tokenizer is built like Gemma 4's, with transformers' own `GemmaTokenizer`
class: SentencePiece-style tokens ("▁" for spaces, the 256 "<0xXX>" byte tokens), BPE merges
trained here (tokenizers' trainer, on words that start at a "▁" as SentencePiece's do), with
Gemma 4's layout on top: the five specials first, the chat markers (`<|turn>`, `<turn|>`, the
channel, tool and quote tokens) as special tokens, and the runs of newlines, of "▁" and of
tabs as ordinary tokens whose merges rank first, as in the real vocabulary; the newline runs
are also added tokens, as transformers' SentencePiece converter makes a user-defined piece
(matched whole, longest first, before any merge). The GGUF is
written by llama.cpp's converter's own steps (`gguf.LlamaHfVocab`, `gguf.SpecialVocab` with
merges, the visible chat markers retyped as user-defined, no space prefix, BOS added).

Negative controls: the same merges run on raw spaces (the "▁" marker left out), or taken in
the reverse order of their ranks, give other ids than HF on this sample; and a newline run
the merges cannot reach is still one token (llama.cpp's rule), where merges alone give one
token a newline. The vocabulary the converter wrote for Gemma 4 itself (llama.cpp's
test file, 262,144 tokens) was checked by hand against the ids HF gave for its 46 test texts
(docs/models.md); it is too large to keep in the tree.
"""

from __future__ import annotations

import gguf
import pytest
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from models.config import UnsupportedModelError
from models.tokenizer import Tokenizer
from tests.models.test_tokenizer import CORPUS as BASE_CORPUS

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
CHAT_MARKERS = ["<|turn>", "<turn|>", "<|think|>", "<|tool>", "<tool|>"]
# The converter writes these as user-defined (always rendered, for the chat parser).
VISIBLE = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
           '<|"|>']
# test_tokenizer's training text, with a paragraph break (Gemma 4 keeps newline runs whole)
CORPUS = BASE_CORPUS + ["The model answers in the same language as the question.\n\nThen it stops."] * 8
TEXTS = [
    "Hello world!",
    " leading space and trailing  ",
    "  multiple   spaces\t\ttabs\n\n\nnewlines\n",
    "def f(x):\n    return x**2  # comment\n\n\n\n\n\n\n\n\n",  # a newline run longer than any token
    "café naïve 日本語 Привет",  # characters the merges never saw: their UTF-8 bytes
    "😀👍🏽 emoji 🇫🇷",
    "12345 67 8.9",
    "<|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>Paris.<turn|>",
    'call:get{city:<|"|>Paris<|"|>}<tool_call|>',
    "<|turn>user partial <|turn not a marker",
    "",
    " ",
    "\n",
    "\n\n",
    "x" * 120,
]


def _tiny_gemma4_tokenizer(folder):
    """transformers' GemmaTokenizer over a tiny vocabulary laid out as Gemma 4's (module docstring)."""
    from transformers import GemmaTokenizer

    trainer_tok = BackendTokenizer(BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.Split("▁", behavior="merged_with_next"),  # SentencePiece's words begin at a space
    ])
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=330, show_progress=False))
    trained = trainer_tok.get_vocab()
    trained_merges = _merges_from_json(trainer_tok)

    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for token in SPECIALS + CHAT_MARKERS + VISIBLE:
        add(token)
    # Runs of 1 to 6 newlines, "▁" and tabs; as in Gemma 4's file, every split of a run is a
    # merge, the longest runs' first (the 6-run from 5+1, then 4+2, ..., the 5-run, ...).
    runs = [char * n for char in ("\n", "▁", "\t") for n in range(1, 7)]
    run_merges = [(char * i, char * (n - i)) for n in range(6, 1, -1) for char in ("\n", "▁", "\t")
                  for i in range(n - 1, 0, -1)]
    for token in runs:
        add(token)
    trained_merges = [m for m in trained_merges if m[0] + m[1] not in runs]  # the runs' merges are the ones above
    for b in range(256):
        add(f"<0x{b:02X}>")
    for token in sorted(trained, key=trained.get):
        add(token)
    tok = GemmaTokenizer(vocab=vocab, merges=run_merges + trained_merges,
                         additional_special_tokens=CHAT_MARKERS + VISIBLE)
    tok.add_tokens([AddedToken("\n" * n, normalized=False, special=False) for n in range(1, 7)])
    tok.save_pretrained(folder)
    return tok


def _merges_from_json(backend: BackendTokenizer) -> list[tuple[str, str]]:
    import json

    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _write_gemma4_gguf(folder, path) -> None:
    """The converter's `Gemma4Model.set_vocab`, step for step, on the tokenizer in `folder`."""
    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in VISIBLE else toktype)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, from the GGUF file; HF's GemmaTokenizer of the checkpoint; the GGUF's metadata)."""
    folder = tmp_path_factory.mktemp("gemma4_vocab")
    hf = _tiny_gemma4_tokenizer(folder)
    path = folder / "vocab.gguf"
    _write_gemma4_gguf(folder, path)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"
    assert len(reader.fields["tokenizer.ggml.merges"].contents()) > 100
    return Tokenizer.from_gguf(reader), hf, {k: f.contents() for k, f in reader.fields.items()}


@pytest.mark.parametrize("text", TEXTS)
def test_gemma4_gguf_encodes_like_the_checkpoints_hf_tokenizer(pair, text):
    ours, hf, _ = pair
    want = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == want
    assert ours.decode(want, skip_special_tokens=False) == hf.decode(want, skip_special_tokens=False)


def test_the_sample_reaches_what_it_is_for(pair):
    """The sample exercises byte fallback, whole newline runs, the chat markers and merges."""
    ours, hf, _ = pair
    vocab = hf.get_vocab()
    ids = [i for text in TEXTS for i in hf.encode(text, add_special_tokens=False)]
    assert any(vocab[f"<0x{b:02X}>"] in ids for b in "日".encode()), "byte fallback"
    assert vocab["\n\n\n"] in ids and vocab["▁▁"] in ids, "runs of newlines and spaces as one token"
    assert {vocab[m] for m in ("<|turn>", "<turn|>", "<|channel>", '<|"|>')} <= set(ids), "chat markers whole"
    assert any(len(t) > 3 and t.startswith("▁") for t in hf.convert_ids_to_tokens(ids)), "merged words"


def test_gemma4_gguf_adds_bos_keeps_markers_and_stops_at_eos(pair):
    ours, hf, meta = pair
    vocab = hf.get_vocab()
    assert ours.encode("Hello") == [vocab["<bos>"]] + hf.encode("Hello", add_special_tokens=False)
    # llama.cpp overrides a file that says otherwise: Gemma 4 is served with its BOS.
    told_not_to = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": False})
    assert told_not_to.encode("Hello")[0] == vocab["<bos>"]
    assert ours.bos_token_id == vocab["<bos>"] and vocab["<eos>"] in ours.stop_token_ids
    text = "<|turn>model\n<|channel>thought\n<channel|>Paris.<turn|>"
    # The converter made the channel markers user-defined: they stay in decoded text, the
    # turn markers are special and skipped, as llama.cpp renders them.
    shown = ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert "<|channel>" in shown and "<|turn>" not in shown and "Paris." in shown


def test_negative_controls_the_space_marker_and_the_merge_ranks_matter(pair):
    """Our backend with the "▁" normalizer left out, or its merges in reverse rank order,
    disagrees with HF on the sample: each part is needed."""
    import json

    ours, hf, _ = pair

    def disagree(edit) -> list[str]:
        spec = json.loads(ours.backend.to_str())
        edit(spec)
        clone = BackendTokenizer.from_str(json.dumps(spec))
        return [t for t in TEXTS if clone.encode(t, add_special_tokens=False).ids
                != hf.encode(t, add_special_tokens=False)]

    def raw_spaces(spec):
        spec["normalizer"] = None

    def reversed_ranks(spec):
        spec["model"]["merges"] = spec["model"]["merges"][::-1]

    assert disagree(lambda spec: None) == [], "the unedited copy agrees"
    assert len(disagree(raw_spaces)) >= 5, "merges without the space marker miss the words after a space"
    assert len(disagree(reversed_ranks)) >= 3, "the merges apply in the order of their ranks in the file"


def test_a_newline_run_in_the_vocabulary_is_one_token_even_where_no_merge_reaches_it(pair):
    """llama.cpp's gemma4 rule (and HF's, whose converter makes such runs added tokens): here
    the file's newline merges are removed, so merges alone would give one token a newline."""
    import json

    _, hf, meta = pair
    vocab = hf.get_vocab()
    kept = [m for m in meta["tokenizer.ggml.merges"] if set(m.replace(" ", "")) != {"\n"}]
    assert len(kept) < len(meta["tokenizer.ggml.merges"])
    ours = Tokenizer.from_gguf({**meta, "tokenizer.ggml.merges": kept})
    text = "a\n\n\nb\n\n\n\n\n\n\n\nc"
    want = [vocab["a"], vocab["\n\n\n"], vocab["b"], vocab["\n" * 6], vocab["\n\n"], vocab["c"]]
    assert ours.encode(text, add_special_tokens=False) == want
    spec = json.loads(ours.backend.to_str())  # the control: the same backend without the rule
    spec["added_tokens"] = [t for t in spec["added_tokens"] if set(t["content"]) != {"\n"}]
    bare = BackendTokenizer.from_str(json.dumps(spec)).encode(text, add_special_tokens=False).ids
    assert bare.count(vocab["\n"]) == 11 and bare != want


def test_a_gemma4_vocabulary_without_merges_is_refused_naming_the_key(pair):
    """As a file without its tokens is: a broken file, named by the key it lacks."""
    _, _, meta = pair
    meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(ValueError, match="'tokenizer.ggml.merges'.*gemma4"):
        Tokenizer.from_gguf(meta)


def test_other_vocabulary_kinds_are_still_refused_by_name_listing_gemma4():
    with pytest.raises(UnsupportedModelError, match="'bert'.*'gemma4'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
