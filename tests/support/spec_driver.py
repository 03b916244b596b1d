"""Runs jobs through the real scheduler and runner, synchronously, with or without
speculation (the owner loop's steps without its thread): what the speculative-decoding
tests compare. Also run as a script in a subprocess with 2 simulated CPU devices:

    python tests/support/spec_driver.py tp CHECKPOINT     # prints one JSON line: tokens off / on, tp=2
    python tests/support/spec_driver.py tp-draft TARGET DRAFT...  # the same per draft, engines built for tp=2
"""

from __future__ import annotations

import dataclasses
import os
import sys

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ferrox_jax.config import SchedulerLimits, SpeculativeConfig  # noqa: E402
from ferrox_jax.draft import DraftModel  # noqa: E402
from ferrox_jax.host_batch import HostBatch  # noqa: E402
from ferrox_jax.speculative import NgramProposer  # noqa: E402
from ferrox_jax.step_output import step_output  # noqa: E402
from ferrox_jax.request import Job, RowSampling  # noqa: E402
from ferrox_jax.scheduler import Scheduler  # noqa: E402

SPEC = SpeculativeConfig(num_speculative_tokens=4, ngram_min=1, ngram_max=3, max_rows=4)
GREEDY = RowSampling(temperature=0.0)
MAX_ROWS = 8  # rows at once in the tests' schedulers
STEP_ROWS = SPEC.step_rows(MAX_ROWS)  # the runner's largest row bucket: 4 speculating rows of 1 + 4 tokens


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[list[int]]]  # request id -> per row index, the tokens
    finish: dict[str, list[str]]  # request id -> per row index, the finish reason
    logprobs: dict[str, list[list[float]]]  # request id -> per row, the chosen tokens' logprobs
    num_steps: int
    scheduler: Scheduler


def limits_for(runner, speculative: SpeculativeConfig | None, max_rows: int = MAX_ROWS,
               prefix_caching: bool = True, state_slots: int = 0) -> SchedulerLimits:
    """`state_slots`: a recurrent model's pool (its runner's slots, the null slot included)."""
    return SchedulerLimits(block_size=runner.block_size, num_blocks=runner.num_blocks - 1, max_rows=max_rows,
                           max_chunk_tokens=runner.max_chunk_tokens, max_context=runner.max_context,
                           prefix_caching=prefix_caching, speculative=speculative, state_slots=state_slots)


def drive(runner, tokenizer, jobs, speculative: SpeculativeConfig | None, max_rows: int = MAX_ROWS,
          on_step=None, draft: DraftModel | None = None, state_slots: int = 0) -> Run:
    """Submits `jobs` (Jobs) and steps until all have finished, each step as
    the owner loop's tick runs it (`ContinuousBatcher._step`, no grammar masks): drafts
    proposed (`draft`, the draft model for `method="draft"` or the MTP draft for "mtp"; else
    prompt lookup), the host batch, the forward, the draft's mirror, the sample, the draft's
    follow, the results.
    `on_step(scheduler, step_index)` runs before each step (to cancel, for instance);
    `state_slots`: a recurrent model's state pool (`limits_for`)."""
    # (prefix caching is off for a recurrent model, as the engine turns it off: ferrox_jax/state_pool.py)
    scheduler = Scheduler(limits_for(runner, speculative, max_rows, prefix_caching=not state_slots,
                                     state_slots=state_slots), tokenizer)
    proposer = draft if speculative is not None and speculative.method in ("draft", "mtp") else (
        NgramProposer(speculative) if speculative is not None else None)
    for job in jobs:
        scheduler.add_job(job)
    run = Run({j.request_id: [[] for _ in range(j.n)] for j in jobs},
              {j.request_id: [""] * j.n for j in jobs}, {j.request_id: [[] for _ in range(j.n)] for j in jobs},
              0, scheduler)
    while scheduler.has_work:
        if on_step is not None:
            on_step(scheduler, run.num_steps)
        plan = scheduler.schedule()
        if plan.draft_requests:
            plan = scheduler.add_drafts(plan, proposer.propose(plan))
        if not plan.is_empty:
            batch = HostBatch.build(plan, runner.geometry)
            pending = runner.forward(batch)
            if draft is not None:
                draft.mirror(batch)
            arrays = runner.sample(pending, None)
            if draft is not None:  # the MTP draft's cache and kept hidden states (a draft model: nothing)
                draft.follow(plan, batch, pending, arrays)
            scheduler.update(plan, step_output(plan, batch, arrays))
            run.num_steps += 1
        for event in scheduler.take_events():
            run.tokens[event.request_id][event.index] += event.token_ids
            if event.logprobs:
                run.logprobs[event.request_id][event.index] += [r.logprob for r in event.logprobs]
            if event.finish_reason:
                run.finish[event.request_id][event.index] = event.finish_reason
    return run


def copy_prompt(tokenizer) -> tuple[int, ...]:
    """A prompt that repeats itself, so prompt lookup finds drafts."""
    line = "def add(a, b):\n    return a + b\n"
    return tuple(tokenizer.encode(line * 3))


def greedy_jobs(tokenizer, max_tokens: int = 24) -> list[Job]:
    prompt = copy_prompt(tokenizer)
    return [Job(request_id=f"r{i}", prompt_token_ids=prompt[i:], max_tokens=max_tokens - i,
                sampling=GREEDY) for i in range(3)]


def _tp_main(path: str) -> None:
    import json

    from ferrox_jax.runner import ModelRunner
    from ferrox_jax.sharding import make_mesh
    from models.loader import load_checkpoint

    ckpt = load_checkpoint(path)
    runner = ModelRunner(ckpt.model, num_blocks=96, block_size=8, max_rows=STEP_ROWS, max_chunk_tokens=64, max_context=256,
                         mesh=make_mesh(1, 2))
    jobs = greedy_jobs(ckpt.tokenizer)
    off = drive(runner, ckpt.tokenizer, jobs, None)
    on = drive(runner, ckpt.tokenizer, jobs, SPEC)
    counters = on.scheduler.speculator.counters
    print(json.dumps({"off": off.tokens, "on": on.tokens, "steps_off": off.num_steps, "steps_on": on.num_steps,
                      "accepted": counters.num_accepted_tokens, "devices": len(runner.mesh.devices.flat)}))


def _tp_draft_main(target: str, drafts: list[str]) -> None:
    """Per draft checkpoint, an engine built by the engine builder for tensor parallelism 2
    with `--speculative draft`: greedy tokens off / on, the counters, and on how many devices
    the draft's weights and KV cache lie."""
    import json

    import jax

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    got = {}
    for draft in drafts:
        spec = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3, max_rows=4)
        engine = Engine.load(EngineConfig(model=target, dtype="float32", tensor_parallel=2, speculative=spec,
                                          kv_blocks=96, block_size=8, max_seqs=MAX_ROWS, prefill_chunk=64,
                                          max_context=256))
        runner, draft_runner = engine.runner, engine.draft_runner
        jobs = greedy_jobs(engine.tokenizer)
        off = drive(runner, engine.tokenizer, jobs, None, draft=DraftModel(draft_runner))
        on = drive(runner, engine.tokenizer, jobs, spec, draft=DraftModel(draft_runner))
        counters = on.scheduler.speculator.counters
        got[draft] = {"off": off.tokens, "on": on.tokens, "drafted": counters.num_draft_tokens,
                      "accepted": counters.num_accepted_tokens,
                      "weight_devices": sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(draft_runner.state)}),
                      "kv_devices": sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(draft_runner.kv_cache)}),
                      "recompiles": draft_runner.recompiles_after_warmup}
    print(json.dumps(got))


if __name__ == "__main__":
    if sys.argv[1] == "tp":
        _tp_main(sys.argv[2])
    elif sys.argv[1] == "tp-draft":
        _tp_draft_main(sys.argv[2], sys.argv[3:])
