"""Incremental detokenization and stop strings across token boundaries."""

from tests.support.scripted import ByteTokenizer

from ferrox_jax.detokenize import IncrementalDetokenizer, StopStringMatcher, TextStream


def stream_text(stream: TextStream, token_ids: list[int]) -> list[str]:
    deltas = []
    for token_id in token_ids:
        deltas.append(stream.add_token(token_id))
        if stream.is_stopped:  # the row ends here; nothing more is fed
            return deltas
    deltas.append(stream.finish())
    return deltas


def test_multibyte_characters_are_never_split_across_deltas():
    tok = ByteTokenizer()
    text = "héllo €uro 😀!"
    detok = IncrementalDetokenizer(tok, tok.encode("prompt "))
    deltas = [detok.add_token(b) for b in text.encode("utf-8")]
    assert all("\ufffd" not in d for d in deltas), f"a delta held half a character: {deltas}"
    assert "".join(deltas) + detok.flush() == text, "the deltas must add up to the whole text"
    # The 4-byte emoji arrives as 4 byte tokens: 3 empty deltas, then the whole character.
    emoji_at = len("héllo €uro ".encode("utf-8"))
    assert deltas[emoji_at:emoji_at + 4] == ["", "", "", "😀"], "the emoji is emitted whole"


def test_invalid_bytes_are_emitted_after_a_characters_worth_of_tokens():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_token(b) for b in [0xFF, ord("a")]]
    # 0xFF can start no character; after 2 held tokens it still decodes to U+FFFD, but only
    # MAX_HELD_TOKENS (4) held tokens make it final, so a short run waits for the flush.
    assert "".join(deltas) + detok.flush() == "\ufffda", "invalid bytes are not dropped"


def test_stop_string_split_across_two_tokens_is_cut_and_never_emitted():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stop=["STOP"])
    deltas = stream_text(stream, tok.ids("hello ST", "OP world"))
    assert stream.is_stopped, "a stop string split over two tokens must be found"
    assert "".join(deltas) == "hello ", "text is cut where the stop string begins"


def test_stop_string_split_across_three_tokens_is_held_back_until_decided():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stop=["<end>"])
    deltas = [stream.add_token(t) for t in tok.ids("ok <e", "n", "d> tail")]
    assert deltas == ["ok ", "", ""], f"a possible stop-string start must be held back: {deltas}"
    assert stream.is_stopped and stream.text == "ok ", "the stop string is cut off"


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stop=["STOP"])
    deltas = stream_text(stream, tok.ids("a ST", "ART", " b ST"))
    assert deltas == ["a ", "START", " b ", "ST"], f"held text released when decided: {deltas}"
    assert not stream.is_stopped


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    released = matcher.add_text("hello world")
    assert matcher.is_stopped and released == "hel", "the stop that starts first cuts the text"


def test_the_matched_stop_string_is_remembered():
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    matcher.add_text("hel")
    assert matcher.matched is None
    matcher.add_text("lo world")
    assert matcher.matched == "lo w", "the one that starts first, as the text is cut there"
    tied = StopStringMatcher(["ab", "abc"])
    tied.add_text("xabc")
    assert tied.matched == "ab", "at one start, the first listed"


def test_stop_string_inside_one_token_mid_token_is_cut():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stop=["\n\n"])
    deltas = stream_text(stream, tok.ids("one", "\n\ntwo"))
    assert stream.is_stopped and "".join(deltas) == "one", "a stop inside a token still cuts"


def test_stop_string_with_multibyte_characters_matches_across_byte_tokens():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stop=["€€"])
    deltas = stream_text(stream, list("a€€b".encode("utf-8")))
    assert stream.is_stopped and "".join(deltas) == "a", "stop strings match decoded text"


def test_prompt_context_does_not_leak_into_output_text():
    tok = ByteTokenizer()
    stream = TextStream(tok, tok.encode("a long prompt"), stop=[])
    assert "".join(stream_text(stream, tok.encode(" and more"))) == " and more"
