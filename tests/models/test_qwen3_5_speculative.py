"""Speculative decoding over Qwen3.5's Gated DeltaNet layers: a verification step runs a row's
last token and its drafts through the recurrent layers, and the next step must continue from
the states after the last *accepted* token (models/deltanet.py, "Speculation").

A tiny random Qwen3.5 never repeats itself, so prompt lookup's drafts are all rejected on it;
the exactness checks therefore draft with an oracle that knows the non-speculative greedy
reply and corrupts it after a chosen number of tokens (0 to k, a different number per row and
step): drafts are partly accepted and partly rejected, by rows of different acceptance
lengths in one step, through the scheduler's and runner's real verification path. Prompt
lookup and a draft model (a tiny Qwen3 of the same vocabulary) run too. The negative control
keeps the states after all 1 + k verified tokens (no rollback) and is caught.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from ferrox_jax.config import EngineConfig, SpeculativeConfig
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.runner import ModelRunner
from ferrox_jax.state_pool import pool_bytes, state_entries
from models import deltanet
from models.loader import load_checkpoint
from tests.support import family_checks as fc
from tests.support.spec_driver import drive

MAX_ROWS = 2  # rows at once
K = 3  # drafts a row verifies
ORACLE = SpeculativeConfig(method="draft", draft_model="oracle", num_speculative_tokens=K, ngram_min=1, ngram_max=3,
                           max_rows=MAX_ROWS)
NGRAM = dataclasses.replace(ORACLE, method="ngram", draft_model=None)
STEP_ROWS = ORACLE.step_rows(MAX_ROWS)  # 2 speculating rows of 1 + 3 tokens: 8 one-token rows
GEOMETRY = dict(num_blocks=64, block_size=8, max_chunk_tokens=16, max_context=128)
SAMPLING = RowSampling(temperature=0.0, logprobs=1)
LOGPROB_ATOL = 1e-5  # the same float32 model; verification rounds a bigger row bucket (~1e-6 seen)


def _runner(ckpt, entries: int, max_rows: int = STEP_ROWS) -> ModelRunner:
    return ModelRunner(ckpt.model, max_rows=max_rows, state_entries=entries, **GEOMETRY)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_spec") / "tiny-qwen3_5")
    ckpt = load_checkpoint(str(path))
    rng = np.random.RandomState(0)
    # Prompts of distinct lengths (the oracle tells rows apart by it), one of them repetitive.
    phrase = rng.randint(0, 380, 7).tolist()
    prompts = [phrase * 3, rng.randint(0, 380, 13).tolist(), rng.randint(0, 380, 26).tolist()]
    jobs = [Job(request_id=f"r{i}", prompt_token_ids=tuple(p), max_tokens=14, sampling=SAMPLING)
            for i, p in enumerate(prompts)]
    # The reference: no speculation, one state entry a slot (the pool as it was before speculation).
    plain = _runner(ckpt, entries=1, max_rows=MAX_ROWS)
    reference = drive(plain, ckpt.tokenizer, jobs, None, max_rows=MAX_ROWS, state_slots=MAX_ROWS + 1)
    spec_runner = _runner(ckpt, entries=state_entries(ORACLE))
    spec_runner.warmup()
    return path, ckpt, jobs, reference, spec_runner


class OracleDrafts:
    """A proposer (the draft model's verbs) drafting the reference reply's next tokens, the
    first `a` right and the next one wrong, `a` cycling through 0..k per row and call (rows
    offset from each other, so rows of one step accept different numbers)."""

    def __init__(self, jobs, reference, vocab_size: int):
        self.reply = {len(j.prompt_token_ids): (len(j.prompt_token_ids), reference.tokens[j.request_id][0])
                      for j in jobs}
        self.vocab_size = vocab_size
        self.calls = collections.Counter()

    def propose(self, plan):
        drafts = []
        for request in plan.draft_requests:
            row = request.row
            prompt_len, reply = self.reply[row.num_prompt_tokens]
            first = row.start_pos + 1 - prompt_len  # the reply's index of the first draft's position
            right = list(reply[first:first + request.num_drafts])
            keep = (self.calls[prompt_len] + prompt_len) % (request.num_drafts + 1)
            self.calls[prompt_len] += 1
            if keep < len(right):
                right[keep] = (right[keep] + 1) % self.vocab_size
            drafts.append(tuple(right))
        return drafts

    def mirror(self, batch):
        pass

    def follow(self, plan, batch, pending, arrays):
        pass


def _drive_oracle(runner, ckpt, jobs, reference):
    """The jobs with oracle drafts; returns (run, [(step, accepted) per verifying row])."""
    verified, step = [], [0]

    def on_step(scheduler, index):
        step[0] = index
        if index == 0:
            record = scheduler.speculator.record

            def counted(plan, result, is_finished):
                verified.append((step[0], len(result.following)))
                record(plan, result, is_finished)

            scheduler.speculator.record = counted

    run = drive(runner, ckpt.tokenizer, jobs, ORACLE, max_rows=MAX_ROWS, on_step=on_step,
                draft=OracleDrafts(jobs, reference, ckpt.config.vocab_size), state_slots=STEP_ROWS + 1)
    return run, verified


def _logprob_error(a, b) -> float:
    return max(float(np.abs(np.asarray(a.logprobs[k][0]) - np.asarray(b.logprobs[k][0])).max()) for k in a.logprobs)


def _prefix_logprob_error(a, b) -> float:
    """Max |Δlogprob| over each row's tokens up to and including the first that differs."""
    err = 0.0
    for k in a.tokens:
        ta, tb = a.tokens[k][0], b.tokens[k][0]
        n = next((i + 1 for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        err = max(err, float(np.abs(np.asarray(a.logprobs[k][0][:n]) - np.asarray(b.logprobs[k][0][:n])).max()))
    return err


def test_partly_accepted_drafts_leave_the_greedy_reply_and_logprobs_unchanged(qwen3_5):
    _, ckpt, jobs, reference, runner = qwen3_5
    run, verified = _drive_oracle(runner, ckpt, jobs, reference)
    counters = run.scheduler.speculator.counters
    assert run.tokens == reference.tokens, "speculation changed the greedy reply"
    err = _logprob_error(run, reference)
    print(f"qwen3_5 speculative: {counters.num_accepted_tokens} of {counters.num_draft_tokens} drafts accepted, "
          f"{run.num_steps} steps (off: {reference.num_steps}), max |Δlogprob| {err:.2e}")
    assert err < LOGPROB_ATOL, f"logprobs moved by {err:.3g}"
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, "drafts both accepted and rejected"
    assert counters.accepted_per_pos[K - 1] > 0, "some verification kept all k drafts"
    by_step = collections.defaultdict(set)
    for step, accepted in verified:
        by_step[step].add(accepted)
    assert any(len(kept) > 1 for kept in by_step.values()), "rows of one step accepted different numbers of drafts"
    assert run.num_steps < reference.num_steps, "accepted drafts save steps"
    assert run.scheduler.states.num_held == 0 and run.scheduler.budget.num_held_blocks == 0
    assert runner.recompiles_after_warmup == 0, "verification compiled a shape after warm-up"


def test_prompt_lookup_runs_and_keeps_the_reply(qwen3_5):
    _, ckpt, jobs, reference, runner = qwen3_5
    run = drive(runner, ckpt.tokenizer, jobs, NGRAM, max_rows=MAX_ROWS, state_slots=STEP_ROWS + 1)
    counters = run.scheduler.speculator.counters
    assert counters.num_draft_tokens > 0, "prompt lookup proposed nothing (nothing was verified)"
    assert run.tokens == reference.tokens, "prompt lookup changed the greedy reply"
    assert _logprob_error(run, reference) < LOGPROB_ATOL
    assert runner.recompiles_after_warmup == 0


def test_a_draft_model_of_the_same_vocabulary_keeps_the_reply(qwen3_5, tmp_path):
    from ferrox_jax.draft import DraftModel

    path, ckpt, jobs, reference, runner = qwen3_5
    draft_cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=512, tie_word_embeddings=False)
    draft_path = fc.make_checkpoint(tmp_path / "draft", draft_cfg)
    draft_runner = _runner(load_checkpoint(str(draft_path)), entries=1)
    spec = dataclasses.replace(ORACLE, draft_model=str(draft_path))
    run = drive(runner, ckpt.tokenizer, jobs, spec, max_rows=MAX_ROWS, draft=DraftModel(draft_runner),
                state_slots=STEP_ROWS + 1)
    assert run.scheduler.speculator.counters.num_draft_tokens > 0, "the draft proposed nothing"
    assert run.tokens == reference.tokens, "the draft model changed the greedy reply"
    assert _logprob_error(run, reference) < LOGPROB_ATOL


def test_negative_control_keeping_the_states_after_every_verified_token_is_caught(qwen3_5, monkeypatch):
    _, ckpt, jobs, reference, _ = qwen3_5

    def no_rollback(part, length, last):
        # the run's last token writes entry 0 and entry 0 follows the run's last position:
        # whatever was accepted, the next step starts after all 1 + k tokens
        return length - 1 - part, last - part + length - 1

    jax.clear_caches()
    monkeypatch.setattr(deltanet, "commit_entries", no_rollback)
    try:
        run, _ = _drive_oracle(_runner(ckpt, entries=state_entries(ORACLE)), ckpt, jobs, reference)
    finally:
        jax.clear_caches()
    err = _logprob_error(run, reference) if run.tokens == reference.tokens else float("inf")
    print(f"no rollback: tokens {'equal' if run.tokens == reference.tokens else 'differ'}, max |Δlogprob| up to "
          f"the first differing token {_prefix_logprob_error(run, reference):.3g}")
    assert err > 1e-3, f"states kept past rejected drafts went unnoticed ({err:.3g})"


def test_speculation_is_served_and_sized_for_these_models():
    spec = deltanet.DeltaNetSpec(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, conv_kernel=4)

    # 1 + k entries a slot, and each slot's position (i32): 3 slots of 2 layers
    per_entry = 2 * (3 * 128 + 4 * 16 * 16) * 4
    assert state_entries(NGRAM) == 1 + K and state_entries(None) == 1
    assert pool_bytes((spec, spec), 3, 1 + K) == 3 * ((1 + K) * per_entry + 4)
    assert pool_bytes((spec, spec), 3) == 3 * per_entry


def test_mtp_and_a_draft_with_recurrent_layers_are_refused_with_the_reason(qwen3_5):
    from ferrox_jax.engine_builder import open_draft
    from ferrox_jax.mtp import check_mtp
    from models.loader import open_checkpoint

    path, ckpt, *_ = qwen3_5
    # --speculative mtp runs on these models' own mtp.* block (tests/models/test_mtp_qwen3_5.py);
    # this checkpoint has none, and is refused naming it.
    mtp = EngineConfig(model=str(path), speculative=SpeculativeConfig(method="mtp"))
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer \(no mtp\.fc\.weight.*--speculative ngram"):
        check_mtp(mtp, open_checkpoint(str(path)), 1)
    # A draft's proposal steps would move its own states past the row's tokens.
    draft = EngineConfig(model=str(path), speculative=SpeculativeConfig(method="draft", draft_model=str(path)))
    with pytest.raises(ValueError, match="recurrent .* not supported; use a draft of attention layers only"):
        open_draft(draft, open_checkpoint(str(path)), None)


def test_served_with_prompt_lookup_through_the_engine_builder(qwen3_5):
    import httpx

    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine, wait_for

    path, ckpt, *_ = qwen3_5
    engine = tiny_engine(path, speculative=NGRAM, **fc.SERVE_LIMITS)
    # 60 distinct tokens: most tokens the reply takes occurred before, so lookup (ngram_min 1)
    # drafts what followed them, and verifies it
    prompt = np.random.RandomState(1).permutation(ckpt.config.vocab_size - 4)[:60].tolist()
    with ServerThread(create_app(engine)) as base, httpx.Client(base_url=base, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stats = wait_for(lambda: (s := http.get("/admin/stats").json())["spec_decode_num_draft_tokens"] and s)
    want = engine.tokenizer.decode(fc.hf_greedy(fc.hf_model(path), prompt, 12))
    assert text == want, "the served greedy reply differs from HF's"
    # the pool the engine allocated and reports: every slot (the null one and the prefix
    # cache's snapshot slots too) 1 + k entries
    slots = 1 + stats["state_slots_total"] + stats["state_snapshot_slots_total"]
    assert stats["state_snapshot_slots_total"] > 0, "prefix caching keeps state snapshots beside speculation"
    assert stats["state_pool_bytes"] == pool_bytes(ckpt.config.recurrent_specs(), slots, 1 + K)
    assert stats["state_slots_held"] == 0 and engine.stats().recompiles_after_warmup == 0


def test_a_verification_run_equals_the_same_tokens_as_one_segment():
    """The decode-segment forms (`run_windows`, `delta_rule_runs`) against the segment kernels
    (`causal_conv`, `gated_delta_rule`) over the same tokens as one row: a run of 4 tokens, a
    plain row and a padding row; a window that ignores the run's earlier inputs, or a run
    started from the slot's state at every token, is caught."""
    rng = np.random.RandomState(3)
    kc, c, h, dk, dv = 4, 6, 2, 3, 3
    f32 = lambda *shape: jnp.asarray(rng.randn(*shape).astype(np.float32))  # noqa: E731
    # padded rows: a run (slot 1, positions 10..13), a plain row (slot 2), padding (slot 0)
    slots, positions = jnp.asarray([1, 1, 1, 1, 2, 0]), jnp.asarray([10, 11, 12, 13, 5, 0])
    valid = jnp.asarray([True] * 5 + [False])
    follows, part, length = deltanet.verification_runs(slots, positions, valid)
    assert part.tolist() == [0, 1, 2, 3, 0, 0] and length.tolist() == [4, 4, 4, 4, 1, 1]
    x, conv0, weight = f32(6, c), f32(6, kc - 1, c), f32(c, 1, kc)
    conv0 = conv0.at[1:4].set(conv0[0])  # a run's rows read its one slot
    q, k = deltanet.l2norm(f32(6, h, dk)), deltanet.l2norm(f32(6, h, dk))
    v, g, beta, state0 = f32(6, h, dv), -jnp.abs(f32(6, h)), jax.nn.sigmoid(f32(6, h)), f32(6, h, dk, dv)
    state0 = state0.at[1:4].set(state0[0])

    def as_rows(windows, states):
        out, conv1 = deltanet.causal_conv(x[:, None], windows, weight, valid.astype(jnp.int32))
        o, after = deltanet.delta_rule_runs(q, k, v, g, beta, states, valid, follows, part)
        return out[:, 0], conv1, o, after

    out, conv1, o, after = as_rows(deltanet.run_windows(x, conv0, part), state0)
    seg_out, seg_conv1 = deltanet.causal_conv(x[None, :4], conv0[:1], weight, jnp.asarray([4]))
    seg_o, seg_state = deltanet.gated_delta_rule(q[None, :4], k[None, :4], v[None, :4], g[None, :4],
                                                 beta[None, :4], state0[:1], valid[None, :4])
    np.testing.assert_allclose(out[:4], seg_out[0], atol=1e-6)
    np.testing.assert_allclose(conv1[3], seg_conv1[0], atol=1e-6)  # the run's last row: the segment's state
    np.testing.assert_allclose(o[:4], seg_o[0], atol=1e-5)
    np.testing.assert_allclose(after[3], seg_state[0], atol=1e-5)
    alone = deltanet.gated_delta_rule(q[None, 4:5], k[None, 4:5], v[None, 4:5], g[None, 4:5], beta[None, 4:5],
                                      state0[4:5], valid[None, 4:5])[1]
    np.testing.assert_allclose(after[4], alone[0], atol=1e-6)  # the plain row: one update from its slot
    # negative controls: each row's window from the slot alone; each row's state from the slot alone
    bad_out = as_rows(conv0, state0)[0]
    assert float(jnp.abs(bad_out[1:4] - seg_out[0, 1:]).max()) > 1e-2, "a window without the run's inputs"
    _, after_slot = deltanet.delta_rule_runs(q, k, v, g, beta, state0, valid, jnp.zeros(6, bool), part * 0)
    assert float(jnp.abs(after_slot[3] - seg_state[0]).max()) > 1e-2, "a run's rows each from the slot's state"
