"""The runner's bucketed steps: chunking, batching, seeds and recompiles."""

import dataclasses

import numpy as np
import pytest

from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.host_batch import HostBatch, bitmask_words
from ferrox_jax.step_output import run_plan, step_output
from ferrox_jax.request import RowSampling
from tests.support.engine_helpers import generate_alone, make_runner, shuffled_blocks

NUM_BLOCKS = 160
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def runner(tiny_llama):
    r, _ = make_runner(tiny_llama, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_rows=8,
                       max_chunk_tokens=64, max_context=256)
    r.warmup()
    return r


def _prompt(n, seed, vocab=300):
    return np.random.RandomState(seed).randint(3, vocab, n).tolist()


def test_chunked_prefill_matches_single_prefill(runner):
    prompt = _prompt(150, 0)
    blocks = tuple(shuffled_blocks(20, NUM_BLOCKS, seed=2))
    whole = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks, sample=False)])[0]
    for chunk in (16, 64):
        parts = []
        for pos in range(0, len(prompt), chunk):
            ids = tuple(prompt[pos:pos + chunk])
            parts.append(runner.run_logits([RowPlan(row_id=0, token_ids=ids, start_pos=pos, block_ids=blocks, sample=False)])[0])
        err = np.abs(np.concatenate(parts) - whole).max()
        assert err < 1e-4, f"chunk {chunk}: logits differ from one-shot prefill by {err}"


def test_chunked_prefill_samples_the_same_first_token(runner):
    prompt = _prompt(100, 1)
    firsts = {chunk: generate_alone(runner, prompt, 4, shuffled_blocks(16, NUM_BLOCKS, chunk), chunk=chunk)
              for chunk in (16, 64)}
    assert firsts[16] == firsts[64], "chunk size changed greedy tokens"


def _decode_rows(prompts, blocks, tokens, sampling):
    return [RowPlan(row_id=i, token_ids=(tokens[i],), start_pos=len(p), block_ids=tuple(blocks[i]), sample=True,
                    sampling=sampling) for i, p in enumerate(prompts)]


def test_batched_decode_equals_each_row_alone(runner):
    lengths = [1, 7, 8, 9, 20, 33, 50, 64]  # 8 rows, around the block size of 8
    prompts = [_prompt(n, 10 + i) for i, n in enumerate(lengths)]
    ids = shuffled_blocks(8 * 10, NUM_BLOCKS, seed=3)
    blocks = [ids[i * 10:(i + 1) * 10] for i in range(8)]
    greedy = RowSampling(temperature=0.0, logprobs=20)
    firsts = []
    for i, p in enumerate(prompts):
        res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=i, token_ids=tuple(p), start_pos=0, block_ids=tuple(blocks[i]),
                                                   sample=True, sampling=greedy),)))
        firsts.append(res.results[i].token_id)
    batch = run_plan(runner, StepPlan(decode=tuple(_decode_rows(prompts, blocks, firsts, greedy)))).results
    for i, p in enumerate(prompts):
        # Alone: the same decode step with only this row (rewrites the same K/V position).
        alone = run_plan(runner, StepPlan(decode=(_decode_rows(prompts, blocks, firsts, greedy)[i],))).results[i]
        assert batch[i].token_id == alone.token_id, f"row {i}: greedy token differs in a batch"
        got = np.array([lp for _, lp in batch[i].top_logprobs])
        want = np.array([lp for _, lp in alone.top_logprobs])
        assert np.abs(got - want).max() < 1e-4, f"row {i}: logprobs differ in a batch"


def test_seeded_row_samples_the_same_alone_and_in_a_batch_of_8(runner):
    sampled = RowSampling(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = _prompt(12, 99)
    own = shuffled_blocks(6, NUM_BLOCKS, seed=5)
    alone = generate_alone(runner, prompt, 12, own, sampling=sampled)
    # Now the same row decodes inside a batch of 8 with different neighbours.
    others = [(_prompt(5 + 3 * i, 200 + i), shuffled_blocks(6, NUM_BLOCKS, seed=50 + i)) for i in range(7)]
    others = [(p, [b for b in bl if b not in own]) for p, bl in others]
    greedy = RowSampling(temperature=0.7, seed=7)
    rows = [(prompt, own, sampled)] + [(p, bl, greedy) for p, bl in others]
    outs = []
    for i, (p, bl, s) in enumerate(rows):
        res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=i, token_ids=tuple(p), start_pos=0, block_ids=tuple(bl),
                                                   sample=True, sampling=s),)))
        outs.append([res.results[i].token_id])
    while len(outs[0]) < 12:
        steps = tuple(RowPlan(row_id=i, token_ids=(outs[i][-1],), start_pos=len(p) + len(outs[i]) - 1,
                              block_ids=tuple(bl), sample=True, sampling=s) for i, (p, bl, s) in enumerate(rows))
        res = run_plan(runner, StepPlan(decode=steps)).results
        for i in range(8):
            outs[i].append(res[i].token_id)
    assert outs[0] == alone, "a seeded row drew different tokens inside a batch"


def test_mixed_workload_after_warmup_causes_zero_recompiles(runner):
    before = runner.recompiles_after_warmup
    for n_rows, length in [(1, 3), (3, 40), (5, 64), (8, 120), (2, 200)]:
        prompts = [_prompt(length, 300 + r) for r in range(n_rows)]
        per_row = (length + 3 + BLOCK_SIZE - 1) // BLOCK_SIZE  # prompt + 2 generated + 1 decoded
        ids = shuffled_blocks(n_rows * per_row, NUM_BLOCKS, seed=n_rows)
        for r, p in enumerate(prompts):
            generate_alone(runner, p, 2, ids[r * per_row:(r + 1) * per_row], chunk=64)
        steps = tuple(RowPlan(row_id=r, token_ids=(5,), start_pos=len(p), block_ids=tuple(ids[r * per_row:(r + 1) * per_row]),
                              sample=True, sampling=RowSampling(temperature=0.8, top_p=0.5, seed=r))
                      for r, p in enumerate(prompts))
        run_plan(runner, StepPlan(decode=steps, block_copies=((ids[0], ids[-1]),)))
    assert runner.recompiles_after_warmup == before == 0, "a step shape escaped the warm-up buckets"


def test_prompt_logprobs_match_the_logits(runner):
    prompt = _prompt(20, 7)
    blocks = tuple(shuffled_blocks(4, NUM_BLOCKS, seed=8))
    logits = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks, sample=False)])[0]
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks,
                                               sample=True, sampling=RowSampling(temperature=0.0, logprobs=2),
                                               prompt_logprobs=True),))).results[0]
    assert len(res.prompt_logprobs) == len(prompt) - 1
    want = [logprobs[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    got = [lp for lp, _ in res.prompt_logprobs]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_masked_row_leaves_its_neighbours_bit_identical(runner, tiny_llama):
    """The same decode step (same shape, same K/V writes) with and without a grammar mask
    on row 0: the other rows' tokens and logprobs are equal bit for bit, and row 0's
    returned logprobs stay the raw model's."""
    from ferrox_jax.constraint import GrammarSpec
    from ferrox_jax.grammar import GrammarCompiler
    from models.tokenizer import Tokenizer

    compiler = GrammarCompiler(Tokenizer.from_hf_dir(tiny_llama), runner.vocab_size)
    prompts = [_prompt(n, 400 + n) for n in (3, 9, 17, 30)]
    ids = shuffled_blocks(4 * 6, NUM_BLOCKS, seed=11)
    blocks = [ids[i * 6:(i + 1) * 6] for i in range(4)]
    settings = [RowSampling(temperature=1.0, seed=3, logprobs=5), RowSampling(temperature=0.0, logprobs=5),
                RowSampling(temperature=1.0, seed=4, logprobs=5), RowSampling(temperature=0.9, top_k=20, seed=5)]
    firsts = [generate_alone(runner, p, 1, blocks[i], sampling=settings[i])[0] for i, p in enumerate(prompts)]
    rows = [RowPlan(row_id=i, token_ids=(firsts[i],), start_pos=len(p), block_ids=tuple(blocks[i]), sample=True,
                    sampling=settings[i]) for i, p in enumerate(prompts)]
    plain = run_plan(runner, StepPlan(decode=tuple(rows)))
    matcher = compiler.new_matcher(GrammarSpec.regex(r"[0-9]{3}"))
    fills = []

    def fill_masks(batch):  # what the owner loop does while the forward runs
        fills.append(batch.constrained.tolist())
        bitmask = np.empty((batch.num_rows, bitmask_words(runner.vocab_size)), np.int32)
        compiler.fill_bitmask(bitmask, [matcher if c else None for c in batch.constrained])
        return bitmask

    masked_rows = (dataclasses.replace(rows[0], is_constrained=True),) + tuple(rows[1:])
    masked_plan = StepPlan(decode=masked_rows)
    masked_batch = HostBatch.build(masked_plan, runner.geometry)
    pending = runner.forward(masked_batch)
    masked = step_output(masked_plan, masked_batch, runner.sample(pending, fill_masks(masked_batch)))
    for i in range(1, 4):
        assert masked.results[i] == plain.results[i], f"row {i} changed next to a masked row"
    assert fills == [[True, False, False, False]], "one fill, for the one constrained row"
    token = masked.results[0].token_id
    assert Tokenizer.from_hf_dir(tiny_llama).decode([token]).isdigit(), "the masked row sampled a digit"
    assert masked.results[0].top_logprobs == plain.results[0].top_logprobs, "raw logprobs, not the masked ones"
    assert runner.recompiles_after_warmup == 0


def test_a_mixed_step_equals_its_rows_run_apart(tiny_llama):
    """Decode rows and prompt chunks in one forward: each row's logprobs equal those of the
    same row in a step of its own, within float32 reordering (the projections see the rows
    together, attention sees each row alone). Two chunks in one step, one of them ending
    its prompt (it samples), the other a middle chunk; a one-token chunk joins the decode
    segment."""
    mixed, _ = make_runner(tiny_llama, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_rows=8,
                           max_chunk_tokens=64, max_context=256, max_chunks=3)
    prompts = [_prompt(n, 500 + n) for n in (5, 12, 30)]
    ids = shuffled_blocks(12 * 7, NUM_BLOCKS, seed=21)
    blocks = [tuple(ids[i * 12:(i + 1) * 12]) for i in range(7)]
    greedy = RowSampling(temperature=0.0, logprobs=5)
    firsts = [generate_alone(mixed, p, 1, blocks[i], sampling=greedy)[0] for i, p in enumerate(prompts)]
    decode = tuple(RowPlan(row_id=i, token_ids=(firsts[i],), start_pos=len(p), block_ids=blocks[i], sample=True,
                           sampling=greedy) for i, p in enumerate(prompts))
    long_prompt, short_prompt, one = _prompt(90, 7), _prompt(40, 8), _prompt(1, 9)
    chunks = (RowPlan(row_id=10, token_ids=tuple(long_prompt[:64]), start_pos=0, block_ids=blocks[3], sample=False),
              RowPlan(row_id=11, token_ids=tuple(short_prompt), start_pos=0, block_ids=blocks[4], sample=True,
                      sampling=greedy),
              RowPlan(row_id=12, token_ids=tuple(one), start_pos=0, block_ids=blocks[5], sample=True, sampling=greedy))
    together = run_plan(mixed, StepPlan(decode=decode, chunks=chunks)).results
    # The same positions again, row by row, into a second copy of each row's blocks.
    apart = {}
    for i, p in enumerate(prompts):
        generate_alone(mixed, p, 1, blocks[6], sampling=greedy)
        row = dataclasses.replace(decode[i], block_ids=blocks[6])
        apart[i] = run_plan(mixed, StepPlan(decode=(row,))).results[i]
    for chunk in chunks[1:]:
        apart[chunk.row_id] = run_plan(mixed, StepPlan(chunks=(dataclasses.replace(chunk, block_ids=blocks[6]),))).results[chunk.row_id]
    assert set(together) == {0, 1, 2, 11, 12}, "every sampling row has a result; the middle chunk has none"
    for row_id, alone in apart.items():
        mixed_row = together[row_id]
        assert mixed_row.token_id == alone.token_id, f"row {row_id}: greedy token changed in the mixed step"
        np.testing.assert_allclose([lp for _, lp in mixed_row.top_logprobs], [lp for _, lp in alone.top_logprobs],
                                   atol=1e-4, err_msg=f"row {row_id}")
    # The middle chunk's K/V is in place: its prompt continues from position 64 as if prefilled alone.
    rest = RowPlan(row_id=10, token_ids=tuple(long_prompt[64:]), start_pos=64, block_ids=blocks[3], sample=True,
                   sampling=greedy)
    assert run_plan(mixed, StepPlan(chunks=(rest,))).results[10].token_id == generate_alone(
        mixed, long_prompt, 1, blocks[6], sampling=greedy)[0]


def test_the_last_layer_finishes_only_each_rows_last_token(runner):
    """A prompt chunk's last-layer MLP runs for its last token only (the one the step reads)
    unless some row reads every token's hidden state: the sampled row's logprobs equal the
    whole-prompt forward's (`run_logits`, every token through every layer) at its last token,
    and the pooled sums, which need every token, are computed only when a row asks."""
    prompt = _prompt(40, 31)
    blocks = tuple(shuffled_blocks(6, NUM_BLOCKS, seed=32))
    whole = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks, sample=False)])[0][-1]
    want = whole - whole.max() - np.log(np.exp(whole - whole.max()).sum())
    for prompt_logprobs in (False, True):
        row = RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks, sample=True,
                      sampling=RowSampling(temperature=0.0, logprobs=20), prompt_logprobs=prompt_logprobs)
        plan = StepPlan(chunks=(row,))
        batch = HostBatch.build(plan, runner.geometry)
        pending = runner.forward(batch)
        pooled = np.asarray(pending.result.hidden_sum)
        res = step_output(plan, batch, runner.sample(pending, None)).results[0]
        assert res.token_id == int(np.argmax(whole))
        got = dict(res.top_logprobs)
        np.testing.assert_allclose([got[t] for t in np.argsort(-want)[:20]], np.sort(want)[::-1][:20], atol=1e-5)
        if prompt_logprobs:
            assert np.abs(pooled).max() > 0, "every token's hidden state, when a row reads them"
        else:
            assert not pooled.any(), "the other tokens' last-layer MLP ran though nothing reads it"
