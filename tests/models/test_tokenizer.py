"""Tokenizer: GGUF- and HF-built tokenizers encode/decode like their references, stop
tokens are found, and chat templates render in a sandbox that refuses escapes.

References: transformers' own GGUF tokenizer for the default SmolLM2 file (slow tests),
a sentencepiece model trained here for the SentencePiece ("llama") GGUF path, and
hand-written expectations for the HF-folder path.
"""

from __future__ import annotations

import io
import json
import os
import re

import gguf
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from models.config import UnsupportedModelError
from models.tokenizer import FALLBACK_CHAT_TEMPLATE, ChatTemplateError, Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others decode.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000; unicode café naïve.",
] * 8
TEXTS = [
    "Hello world!",
    " leading space",
    "12345 67 8.9 a1b22c333",
    "café naïve 日本語 한국어 Привет",
    "😀👍🏽 emoji 🇫🇷 and ZWJ 👩‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n",
    "  multiple   spaces\t\ttabs\n\n\nnewlines  ",
    "don't I'll we've HELLO'S",
    "http://example.com/a?b=c&d=e",
    "",
    " ",
    "\n",
    "x" * 200,
]
CHAT_TEXTS = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "partial <|im_start| not special",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the GPU cross the road?"},
        {"role": "user", "content": "Why? 🤔"},
    ],
]


# -- the default model's GGUF vs transformers ----------------------------------------------


@pytest.fixture(scope="module")
def default_pair():
    """(ours, transformers') tokenizers for the default SmolLM2 GGUF."""
    transformers = pytest.importorskip("transformers")
    from models.loaders.gguf import default_model_path, open_gguf

    path = default_model_path()
    ours = Tokenizer.from_gguf(open_gguf(path))
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, hf


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS + CHAT_TEXTS)
def test_default_gguf_encode_decode_match_transformers(default_pair, text):
    ours, hf = default_pair
    ids = ours.encode(text)
    assert ids == hf.encode(text), "encode must match transformers' GGUF tokenizer"
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system+user", "multi-turn"])
def test_default_chat_template_matches_transformers(default_pair, conversation, add_generation_prompt):
    ours, hf = default_pair
    want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == want


@pytest.mark.slow
def test_default_special_ids_and_stop_tokens(default_pair):
    ours, _ = default_pair
    im_end, endoftext = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.eos_token_id == im_end, "SmolLM2's GGUF eos is <|im_end|>"
    assert ours.stop_token_ids == frozenset({im_end, endoftext})
    assert ours.encode("<|im_start|>") == [ours.token_to_id("<|im_start|>")], "control token is one id"
    assert ours.encode("hi")[0] != ours.bos_token_id, "tokenizer.ggml.add_bos_token is false"
    assert ours.vocab_size == 49152


# -- byte-level GGUF pre-tokenizers -----------------------------------------------------------


def _byte_level_metadata(pre: str, **extra) -> dict:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + ["<|begin_of_text|>", "<|eot_id|>"]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
        "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1, **extra,
    }


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def test_llama_bpe_pre_tokenizer_splits_digits_in_threes_and_adds_bos():
    tok = Tokenizer.from_gguf(_byte_level_metadata("llama-bpe"))
    assert _pieces(tok, "Hello world 12345 don't") == ["Hello", "Ġworld", "Ġ", "123", "45", "Ġdon", "'t"]
    assert tok.encode("a")[0] == tok.bos_token_id, "llama.cpp adds BOS for llama-bpe by default"
    assert tok.stop_token_ids == frozenset({tok.token_to_id("<|eot_id|>")})


def test_smollm_pre_tokenizer_splits_every_digit():
    tok = Tokenizer.from_gguf(_byte_level_metadata("smollm"))
    assert _pieces(tok, "a 123") == ["a", "Ġ", "1", "2", "3"]
    assert tok.encode("a") == [tok.token_to_id("a")], "no BOS by default for non-llama3 byte-level"


def test_add_bos_token_flag_overrides_the_default():
    tok = Tokenizer.from_gguf(_byte_level_metadata("llama-bpe", **{"tokenizer.ggml.add_bos_token": False}))
    assert tok.encode("a") == [tok.token_to_id("a")]


def test_unknown_pre_tokenizer_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'mystery-pre'"):
        Tokenizer.from_gguf(_byte_level_metadata("mystery-pre"))


def test_unknown_tokenizer_model_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_gguf({**_byte_level_metadata("default"), "tokenizer.ggml.model": "bert"})


# -- SentencePiece ("llama") GGUF vs the sentencepiece library ---------------------------------


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """(ours built through a real GGUF file, sentencepiece processor) for a tiny SPM BPE model.

    Trained like Llama's tokenizer.model: BPE, byte fallback, identity normalization,
    whitespace kept, dummy prefix on. Metadata written as llama.cpp's converter does.
    """
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        user_defined_symbols=["<tool>"], minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if sp.id_to_piece(i) == "<tool>" else 1 for i in range(n)]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path))), sp


SPM_TEXTS = [
    "The quick brown fox.", "Hello world", "  two leading spaces", "tabs\tand\nnewlines\n",
    "unseen chars: 日本語 😀 ß", "digits 12345", "quick, brown; fox!", "a", "",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_matches_sentencepiece(spm_pair, text):
    ours, sp = spm_pair
    want = sp.encode(text)
    assert ours.encode(text, add_special_tokens=False) == want
    assert ours.decode(want) == sp.decode(want)


def test_sentencepiece_gguf_adds_bos_and_keeps_specials_whole(spm_pair):
    ours, sp = spm_pair
    assert ours.encode("Hello") == [1] + sp.encode("Hello"), "llama SPM defaults to add_bos"
    # As llama.cpp: text after a special token gets the space prefix again.
    assert ours.encode("</s>Hello", add_special_tokens=False) == [2] + sp.encode("Hello")
    tool = sp.piece_to_id("<tool>")
    assert tool in ours.encode("x <tool> y"), "user-defined token is one id"
    assert "<tool>" in ours.decode(ours.encode("x <tool> y")), "user-defined token is not special"
    assert ours.stop_token_ids == frozenset({2})
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")


# -- HF folder --------------------------------------------------------------------------------


SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def write_hf_tokenizer(folder, *, chat_template=CHATML, jinja_file=None, generation_eos=True):
    """A byte-level BPE trained on CORPUS, BOS-prepending post-processor, ChatML template."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))],
    )
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    if generation_eos:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")]}, f)
    if jinja_file is not None:
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(jinja_file)
    return folder


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return Tokenizer.from_hf_dir(write_hf_tokenizer(tmp_path_factory.mktemp("hf") / "tok"))


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nhi<|im_end|>"])
def test_hf_dir_round_trips_and_prepends_bos(hf_tok, text):
    ids = hf_tok.encode(text)
    assert ids[0] == hf_tok.bos_token_id == hf_tok.token_to_id("<s>"), "post-processor adds BOS"
    assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]
    assert hf_tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert hf_tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_hf_dir_special_ids_and_stop_tokens(hf_tok):
    eos, im_end = hf_tok.token_to_id("</s>"), hf_tok.token_to_id("<|im_end|>")
    assert hf_tok.eos_token_id == eos and hf_tok.pad_token_id == eos
    assert hf_tok.stop_token_ids == frozenset({eos, im_end})
    assert hf_tok.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    think = hf_tok.token_to_id("<think>")
    assert hf_tok.encode("a<think>b", add_special_tokens=False).count(think) == 1
    assert hf_tok.decode([think]) == "<think>", "a non-special added token survives skip_special_tokens"


def test_hf_dir_stop_tokens_come_from_generation_config_too(tmp_path):
    """Without a generation_config.json, <|im_end|> is still found by name."""
    tok = Tokenizer.from_hf_dir(write_hf_tokenizer(tmp_path / "t", generation_eos=False))
    assert tok.stop_token_ids == frozenset({tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")})


def test_hf_dir_chat_template_renders(hf_tok):
    got = hf_tok.apply_chat_template(CONVERSATIONS[1])
    assert got == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                   "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert hf_tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there!<|im_end|>\n")


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    tok = Tokenizer.from_hf_dir(write_hf_tokenizer(tmp_path / "t", jinja_file="{{ bos_token }}J{{ eos_token }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>J</s>"


def test_missing_template_uses_documented_fallback(tmp_path):
    tok = Tokenizer.from_hf_dir(write_hf_tokenizer(tmp_path / "t", chat_template=None))
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(msgs) == "system: S\n\nuser: U\n\nassistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: S\n\nuser: U\n\n"
    assert "assistant:" in FALLBACK_CHAT_TEMPLATE


def test_missing_tokenizer_json_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# -- the sandboxed template environment -------------------------------------------------------


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     chat_template=template)


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutating methods
])
def test_sandbox_escapes_raise_chat_template_error(hf_tok, template):
    with pytest.raises(ChatTemplateError, match="the template sandbox forbids"):
        _with_template(hf_tok, template).apply_chat_template(USER)


def test_raise_exception_becomes_chat_template_error_with_its_message(hf_tok):
    tok = _with_template(hf_tok, "{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tok.apply_chat_template(USER)


@pytest.mark.parametrize("template,pattern", [
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[0]['content'] + 1 }}", "failed while rendering: can only concatenate"),
    ("{{ messages[5]['content'] + 'x' }}", "chat template failed"),
])
def test_broken_templates_raise_chat_template_error(hf_tok, template, pattern):
    with pytest.raises(ChatTemplateError, match=pattern) as e:
        _with_template(hf_tok, template).apply_chat_template(USER)
    assert not re.search(r"[A-Z]\w*Error\b", str(e.value)), f"a class name reaches the client: {e.value}"


def test_template_helpers_behave_like_transformers(hf_tok):
    tok = _with_template(
        hf_tok,
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}|{{ 'tool_calls' in messages[0] }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    )
    msgs = [{"role": "user", "content": "<b>&é</b>", "tool_calls": None}, {"role": "assistant", "content": "x"}]
    rendered, year, has_tool_calls, roles = tok.apply_chat_template(msgs).split("|")
    assert rendered == '{"role": "user", "content": "<b>&é</b>"}', "tojson: no HTML escaping, unicode kept"
    assert re.fullmatch(r"\d{4}", year)
    assert has_tool_calls == "False", "keys whose value is None are dropped"
    assert roles == "user", "loopcontrols extension enabled"
