"""A row's output life on the row (`ferrox_jax/request.py:Row`), driven by hand with no
scheduler and no device: what each sampled token does to it, when it ends, what its event
carries. (tests/engine/test_scheduler.py runs the same rules through whole ticks.)"""

from __future__ import annotations

import collections
import math

from ferrox_jax.request import Job, JobState, RowResult
from ferrox_jax.row_state import RowState, transition
from tests.support.scripted import EOS, ByteTokenizer

STOPS = frozenset({EOS})  # the tokenizer's stop tokens, as the scheduler passes them


def decoding_row(**job_fields):
    """Row 0 of a fresh job over the prompt "hi", already decoding, and its state counts."""
    fields = {"max_tokens": 8, **job_fields}
    job = JobState(Job(request_id="r", prompt_token_ids=(ord("h"), ord("i")), **fields), 1, ByteTokenizer())
    row, counts = job.rows[0], collections.Counter()
    transition(row, RowState.DECODING, counts)
    return row, counts


def accept_all(row, counts, tokens):
    """Each token sampled in turn; what `accept_token` returned for each."""
    return [row.accept_token(RowResult(row.row_id, token), STOPS, counts) for token in tokens]


def test_a_stop_token_ends_the_row_outside_its_output():
    row, counts = decoding_row()
    assert accept_all(row, counts, [ord("a"), EOS]) == [None, RowState.FINISHED_STOP]
    event = row.take_event()
    assert (event.token_ids, event.text) == ((ord("a"),), "a"), "the stop token is not output"
    assert event.finish_reason == "stop" and event.stop_token.token_id == EOS and event.stop_string is None
    assert event.num_generated_tokens == 2, "the stop token is counted among the sampled tokens"
    assert counts[RowState.FINISHED_STOP] == 1


def test_stop_tokens_are_banned_until_min_tokens_then_end_the_row():
    row, counts = decoding_row(min_tokens=2, stop_token_ids=(ord("x"),))
    bias = dict(row.step_sampling(STOPS).logit_bias)
    assert bias == {ord("x"): -math.inf, EOS: -math.inf}, "both kinds of stop token banned below min_tokens"
    assert row.penalty_history(STOPS) == (ord("h"), ord("i")), "a biased draw sees the tokens so far"
    assert accept_all(row, counts, [ord("a"), ord("b")]) == [None, None]
    assert row.step_sampling(STOPS) is row.sampling, "from min_tokens on, the row's own settings"
    assert row.penalty_history(STOPS) == (), "no penalties, no history sent"
    assert accept_all(row, counts, [ord("x")]) == [RowState.FINISHED_STOP]
    early, counts = decoding_row(min_tokens=2)
    assert accept_all(early, counts, [EOS]) == [None], "a stop token sampled below min_tokens does not end it"


def test_ignore_eos_keeps_going_through_the_tokenizers_stop_tokens():
    row, counts = decoding_row(ignore_eos=True, max_tokens=3)
    assert accept_all(row, counts, [EOS, ord("a"), ord("b")]) == [None, None, RowState.FINISHED_LENGTH]
    assert row.take_event().finish_reason == "length"


def test_max_tokens_ends_the_row_with_length():
    row, counts = decoding_row(max_tokens=2)
    assert accept_all(row, counts, b"ab") == [None, RowState.FINISHED_LENGTH]
    event = row.take_event()
    assert (event.text, event.finish_reason, event.num_generated_tokens) == ("ab", "length", 2)


def test_a_stop_string_cuts_the_text_where_it_starts():
    row, counts = decoding_row(stop=("cd",))
    assert accept_all(row, counts, b"abcd") == [None, None, None, RowState.FINISHED_STOP]
    event = row.take_event()
    assert (event.text, event.stop_string, event.finish_reason) == ("ab", "cd", "stop")


def test_finish_releases_the_text_held_back_for_a_possible_stop_string():
    row, counts = decoding_row(stop=("cd",))
    accept_all(row, counts, b"ac")
    assert row.take_event().text == "a", "'c' may start the stop string: held back"
    assert row.finish(RowState.FINISHED_CANCELLED, counts) is RowState.FINISHED_CANCELLED
    event = row.take_event()
    assert (event.text, event.finish_reason) == ("c", "cancelled"), "a row ending otherwise releases it"


def test_a_grammar_rejecting_its_sampled_token_ends_the_row_with_an_error():
    class Rejecting:
        error = "no such token here"
        is_finished = False

        def accept(self, token_id):
            return False

    job = JobState(Job(request_id="g", prompt_token_ids=(1, 2), max_tokens=4, grammar=object()), 1,
                   ByteTokenizer(), new_matcher=lambda grammar: Rejecting())
    row, counts = job.rows[0], collections.Counter()
    transition(row, RowState.DECODING, counts)
    assert accept_all(row, counts, [ord("a")]) == [RowState.FINISHED_ERROR]
    event = row.take_event()
    assert event.finish_reason == "error" and "rejected sampled token" in event.error
    assert event.token_ids == (), "the rejected token is not output"
