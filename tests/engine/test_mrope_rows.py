"""M-RoPE positions on the scheduler's rows (Qwen2.5-VL / Qwen3-VL), against the scripted runner:
every row of a job whose images carry grids — its prompt chunks, its decoding rows, and its
recompute after a preemption — carries the job's images (`RowPlan.rope_images`), and each step's
host batch holds their 3-D positions (`ferrox_jax/images.py:mrope_positions`), the rows of other
jobs their plain positions; a job whose images have no grid (Gemma 3, SmolVLM) carries none and
its steps no column (negative control: the column is absent, not all-equal). Padding lays each
token's 3-D positions beside it, a speculating row's drafts (spread over one-token rows) included."""

from __future__ import annotations

import hashlib

import numpy as np

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.host_batch import HostBatch
from ferrox_jax.images import ImageSpan, mrope_positions
from ferrox_jax.request import Job
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

# embeds as the owner attaches them (the scripted runner's image width is 0)
GRID = ImageSpan(2, 4, hashlib.sha256(b"image").digest(), embeds=np.zeros((4, 0), np.float32), bidirectional=False,
                 grid=(1, 1, 4))


def _make():
    limits = SchedulerLimits(block_size=4, num_blocks=20, max_rows=4, max_chunk_tokens=16, prefix_caching=True,
                             scheduling_policy="priority")
    runner = ScriptedRunner(block_size=4, num_blocks=21, max_rows=16, max_chunk_tokens=16,
                            token_fn=letters_token_fn(), max_chunks=limits.max_chunks)
    return Scheduler(limits, ByteTokenizer()), runner


def _job(request_id, priority, images=()):
    prompt = tuple(100 + (i * 7 + len(request_id) * 3) % 20 for i in range(8))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=24, priority=priority, images=images)


def _run(images):
    """An image job and a text job decode, an urgent job preempts the image job (the least urgent);
    returns every plan."""
    scheduler, runner = _make()
    outputs = {}
    scheduler.add_job(_job("img", 3, images))
    scheduler.add_job(_job("text", 2))
    for _ in range(7):  # 13 of its positions computed, 12 in named blocks: it recomputes one
        tick(scheduler, runner, outputs)
    scheduler.add_job(_job("fg", -3))
    run_until_idle(scheduler, runner, outputs)
    assert scheduler.num_preemptions == 1
    return runner.plans


def test_every_row_of_an_mrope_job_carries_its_images_and_positions():
    plans = _run((GRID,))
    image_rows = [(plan, row) for plan in plans for row in plan.decode + plan.chunks if row.row_id == 1]
    assert any(row.start_pos > 0 and not row.sample for _, row in image_rows), "the image job recomputed"
    assert any(len(row.token_ids) == 1 and row.start_pos >= 8 for _, row in image_rows), "the image job decoded"
    assert all(row.rope_images == (GRID,) for _, row in image_rows)
    assert all(not row.rope_images for plan in plans for row in plan.decode + plan.chunks if row.row_id != 1)
    geometry = ScriptedRunner(block_size=4, num_blocks=21, max_rows=16, max_chunk_tokens=16).geometry
    for plan in plans:
        rows = plan.decode + plan.chunks
        batch = HostBatch.build(plan, geometry)
        if not any(row.row_id == 1 for row in rows):
            assert batch.rope_positions is None
            continue
        for i, row in enumerate(rows):
            lo, hi = batch.row_starts[i], batch.row_starts[i + 1]
            want = (mrope_positions(batch.positions[lo:hi], (GRID,)) if row.row_id == 1
                    else np.repeat(batch.positions[lo:hi, None], 3, 1))
            assert np.array_equal(batch.rope_positions[lo:hi], want)
    # the image (1 x 4 tokens at 2..5) moves what follows by max(1, 4) - 4 = 0 on its rows; its own
    # tokens sit on the grid: (2, 2, 2), (2, 2, 3), (2, 2, 4), (2, 2, 5)
    assert mrope_positions(np.arange(8), (GRID,))[2:6].tolist() == [[2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 2, 5]]


def test_images_without_a_grid_carry_no_positions():
    plain = ImageSpan(GRID.start, GRID.length, GRID.digest, embeds=GRID.embeds, bidirectional=False)
    plans = _run((plain,))
    assert all(not row.rope_images for plan in plans for row in plan.decode + plan.chunks)
    geometry = ScriptedRunner(block_size=4, num_blocks=21, max_rows=16, max_chunk_tokens=16).geometry
    assert all(HostBatch.build(plan, geometry).rope_positions is None for plan in plans)


def test_a_grid_that_does_not_hold_the_image_is_refused():
    import dataclasses

    import pytest

    with pytest.raises(ValueError, match=r"grid \(t, rows, cols\) must hold its 4 tokens; got \(1, 2, 3\)"):
        _job("bad", 0, (dataclasses.replace(GRID, grid=(1, 2, 3)),))
    assert _job("good", 0, (GRID,)).images == (GRID,)


def test_padding_lays_each_tokens_3d_positions_beside_it_speculating_rows_included():
    from ferrox_jax.buckets import Buckets
    from ferrox_jax.host_batch import BatchGeometry
    from ferrox_jax.padding import pad_batch
    from ferrox_jax.plan import RowPlan, StepPlan

    shifted = ImageSpan(2, 4, GRID.digest, embeds=np.zeros((4, 8), np.float32), bidirectional=False, grid=(1, 2, 2))
    blocks = tuple(range(1, 9))
    rows = (RowPlan(1, (5, 6, 7), 20, blocks, True, num_draft_tokens=2, rope_images=(shifted,)),  # verifying 2 drafts
            RowPlan(2, (9,), 11, blocks, True),  # a text job decoding
            RowPlan(3, tuple(range(10, 18)), 0, blocks, True, images=(shifted,), rope_images=(shifted,)))  # a chunk
    plan = StepPlan(decode=rows[:2], chunks=rows[2:])
    batch = HostBatch.build(plan, BatchGeometry(4, 8, 100, image_width=8, mrope=True))
    _, order, out = pad_batch(batch, Buckets.derive(8, 16, 2), 8, False, image_width=8, mrope=True)
    seen = 0
    for t in np.flatnonzero(out.valid):
        host = rows[order[out.row_of_token[t]]]
        position = int(out.positions[t])
        want = mrope_positions(np.array([position]), host.rope_images)[0]
        assert out.rope_positions[t].tolist() == want.tolist(), (host.row_id, position)
        seen += 1
    assert seen == 3 + 1 + 8
    # the image (2 x 2 tokens at 2..5) moves what follows by max(2, 2) - 4 = -2
    assert out.rope_positions[np.flatnonzero(out.valid & (out.positions == 20))[0]].tolist() == [18, 18, 18]
    # a model without M-RoPE: no column at all
    plain = pad_batch(HostBatch.build(plan, BatchGeometry(4, 8, 100, image_width=8)), Buckets.derive(8, 16, 2), 8,
                      False, image_width=8)[2]
    assert plain.rope_positions is None
