"""The scheduler: plans one tick as a `StepPlan` and applies its `StepOutput`. No jax here.

Owned by the batcher's owner thread (no locks). A tick, in the contract's order:

    schedule():  1 apply cancellations   2 flush finished rows   3 admit waiting jobs (FIFO, or by
                 priority with preemption: ferrox_jax/priority.py)
                 4 plan the decode rows   5 plan prompt chunks within the token budget
                 6 name the rows that may verify drafts (speculation)   7 measure the peak
    add_drafts(plan, proposer's drafts)  (speculation) the drafts join their rows
    the runner's step over the plan's host batch: one forward for the decode rows and the chunks
    update():    8 apply results (advance progress; each row takes its tokens)   9 flush finished rows

Progress is `num_computed_tokens` catching up with `len(token_ids)`: a chunk is that
catch-up capped by `max_chunk_tokens`, a decode row a catch-up of one. Every decoding row
computes one token per step; prompt chunks fill the step's token budget
(`max_batched_tokens`, prompt tokens) round robin over the prefilling jobs, one chunk per
job, at most `max_chunks` of them: with the budget equal to the chunk size that is the
contract's one chunk per tick. A prompt whose start is in the prefix cache starts its
catch-up after the cached part. When no row is decoding, nobody's next token waits on the
chunks, so a chunk may take up to `idle_chunk_tokens` (a larger bucket) and a lone long
prompt reaches its first token sooner.

Blocks are `ferrox_jax/block_tables.py`'s business: admission looks the prompt up in the prefix
cache and promises the job its lifetime worst case of new blocks; planning grows tables and copies
a shared block before a row writes into it; `update` names the blocks a step completed; finished
rows release theirs (with `--kv-offload-gib` the plan carries the host tier's copies too). For
`n > 1` the prompt (all but its last token) is prefilled once and each row starts as a prefix hit
on it, sampling with its own seed. A recurrent model's rows hold a state slot (`self.states`).

The scheduler does the scheduling: admission, blocks, chunking, budgets, and when each row
computes. What a sampled token does to a row is the row's own (`ferrox_jax/request.py:Row`):
its next draw's settings (`step_sampling`: stop tokens banned before min_tokens), taking a
token with its stop checks, grammar and text (`accept_token`), its end (`finish`) and its
events (`take_event`). The scheduler counts what they report and frees a finished row's
blocks.

Preemption (the priority policy only): when the most urgent waiting job does not fit, the least
urgent running job gives way (`_make_room`, `_preempt`): its blocks are freed, its rows go back to
WAITING keeping their output, and on re-admission a row that had decoded recomputes its prompt and
output (`_plan_history_chunk`) before it decodes again, its next draw keyed by (seed, position).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from ferrox_jax.admission import AdapterSlots, check_admission  # noqa: F401 (check_admission: the batcher's)
from ferrox_jax.block_tables import BlockTables, blocks_to_reserve  # noqa: F401
from ferrox_jax.config import SchedulerLimits
from ferrox_jax.images import chunk_end, overlapping, rope_images
from ferrox_jax.plan import RowPlan, StepOutput, StepPlan
from ferrox_jax.preemption import Preemption
from ferrox_jax.priority import WaitingQueue
from ferrox_jax.speculative import Speculator
from ferrox_jax.request import Job, JobState, MatcherFactory, Row, RowEvent, RowResult
from ferrox_jax.row_state import RowState, transition

# A cancel for an id not seen yet (its submit may be on its way) is kept this long, at most this many.
PENDING_CANCEL_TTL_S = 60.0
MAX_PENDING_CANCELS = 1024


class Scheduler(Preemption):
    """Plans ticks over waiting, prefilling and decoding jobs; see the module docstring."""

    def __init__(self, limits: SchedulerLimits, tokenizer: Any, *, new_matcher: MatcherFactory | None = None,
                 clock: Callable[[], float] = time.monotonic, adapters: AdapterSlots | None = None) -> None:
        """`new_matcher` makes constrained rows' grammar state (the engine's grammar compiler);
        without one, the batcher refuses constrained jobs at submit. `adapters`: the LoRA
        adapters' slots (`ferrox_jax/admission.py`); without them a job naming one is refused."""
        self.limits = limits
        self._new_matcher = new_matcher
        self._adapters = adapters
        self.blocks = BlockTables(limits)
        self.budget = self.blocks.budget
        self.states = self.blocks.states  # recurrent state slots by row (none for most models)
        self._tokenizer = tokenizer
        self._eos_token_ids = frozenset(getattr(tokenizer, "stop_token_ids", ()) or ())
        self._clock = clock
        self._next_row_id = 1
        self._jobs: dict[str, JobState] = {}  # open jobs by request id
        self._rows: dict[int, Row] = {}  # open rows by row id
        self._waiting = WaitingQueue(limits.scheduling_policy)
        self._preempts = limits.scheduling_policy == "priority"
        self._next_arrival = 0
        self._prefilling: collections.deque[JobState] = collections.deque()  # front is next
        self._decoding: dict[int, Row] = {}  # insertion order is decode priority
        self._cancel_inbox: list[str] = []
        self._pending_cancels: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._to_flush: list[Row] = []
        self._events: list[RowEvent] = []
        self._planned_row_ids: tuple[int, ...] = ()
        # Prompt-lookup drafts for decoding rows (ferrox_jax/speculative.py); None: off.
        self.speculator = Speculator(limits.speculative) if limits.speculative is not None else None
        # Counters (published in BatcherStats by the owner).
        self.prefill_chunks = 0
        self.prefill_tokens = 0
        self.decode_steps = 0
        self.num_admitted = 0  # jobs that left the waiting queue by admission
        self.aborted = 0  # jobs a cancel actually stopped
        self.num_failed_jobs = 0  # jobs ended by a runner error
        self.num_constrained_requests = 0  # jobs whose output a grammar constrains
        self.num_grammar_errors = 0  # rows whose grammar rejected a sampled token (should stay 0)
        self.tokens_generated = 0
        self.kv_blocks_peak = 0
        self.num_preemptions = 0  # jobs preempted for a more urgent one (a job preempted twice counts twice)
        self.state_counts: collections.Counter[RowState] = collections.Counter()

    # -- inputs from the owner loop ----------------------------------------------------

    def add_job(self, submitted: Job) -> None:
        """Queues a job (FIFO); one whose cancel arrived first ends at once, cancelled."""
        assert submitted.request_id not in self._jobs, f"duplicate request id {submitted.request_id!r}"
        job = JobState(submitted, self._next_row_id, self._tokenizer, self._new_matcher)
        self._next_row_id += submitted.n
        self.num_constrained_requests += submitted.grammar is not None
        self._jobs[submitted.request_id] = job
        self._rows.update((row.row_id, row) for row in job.rows)
        self._expire_pending_cancels()
        if self._pending_cancels.pop(submitted.request_id, None) is not None:
            self._stop_job(job, RowState.FINISHED_CANCELLED)
            self.aborted += 1
            self._flush_finished()
        else:
            job.queued_at_s = self._clock()
            job.arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
            self._waiting.append(job)

    def cancel(self, request_id: str) -> None:
        """Asks for a cancel; it is applied first thing in the next `schedule()`."""
        self._cancel_inbox.append(request_id)

    def take_events(self) -> list[RowEvent]:
        events, self._events = self._events, []
        return events

    # -- views -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running_rows(self) -> int:
        """Rows holding a slot: decoding rows plus the rows of prefilling jobs."""
        return len(self._decoding) + sum(job.num_prefilling_rows for job in self._prefilling)

    @property
    def has_work(self) -> bool:
        return bool(self._jobs or self._cancel_inbox or self._events)

    @property
    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapters of jobs holding rows, adapters of waiting jobs), each sorted, unique."""
        running = {job.submitted.adapter_name for job in self._prefilling}
        running |= {row.job.submitted.adapter_name for row in self._decoding.values()}
        waiting = {job.submitted.adapter_name for job in self._waiting}
        return tuple(sorted(running - {None})), tuple(sorted(waiting - {None}))

    @property
    def waiting_request_ids(self) -> tuple[str, ...]:
        return tuple(job.submitted.request_id for job in self._waiting)

    def block_references(self) -> collections.Counter[int]:
        """Block id -> references, counted from the tables of prefilling jobs and rows."""
        return self.blocks.references(self._prefilling, self._rows_with_tables())

    def _rows_with_tables(self) -> list[Row]:
        """Rows holding a block table: decoding rows and rows recomputing after a preemption."""
        return [*self._decoding.values(), *(row for job in self._prefilling for row in job.resume_rows)]

    # -- planning ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans this tick's device work (steps 1-7 of the module docstring)."""
        self._apply_cancellations()
        self._flush_finished()
        self._admit_waiting()
        decode = self._plan_decode_rows()
        chunks = self._plan_chunks(is_idle=not decode)
        requests, max_draft_tokens = (), 0
        if self.speculator is not None:
            decode, requests, max_draft_tokens = self.speculator.plan_drafts(
                decode, self._rows, self.blocks, self.limits.speculative.step_rows(self.limits.max_rows))
        self._update_peak()
        saves, restores, restoring = self.blocks.take_offload()  # the host tier's copies (--kv-offload-gib)
        plan = StepPlan(decode=decode, chunks=chunks, block_copies=self.blocks.take_copies(),
                        draft_requests=requests, max_draft_tokens=max_draft_tokens, kv_saves=saves,
                        kv_restores=restores, window_copies=self.blocks.take_window_copies(),
                        window_slots=self.blocks.window_slots(decode + chunks),
                        state_copies=self.blocks.recurrent.take_copies() if decode or chunks else ())
        # A job restoring host blocks is in this step even without a row in it: if it fails, so does the job.
        self._planned_row_ids = tuple(dict.fromkeys(
            [row.row_id for row in plan.rows] + [row.row_id for job in restoring for row in job.rows]))
        return plan

    def add_drafts(self, plan: StepPlan, drafts: list[tuple[int, ...]]) -> StepPlan:
        """The plan with the proposer's `drafts` (one tuple per `plan.draft_requests`) added
        to their rows, whose tables grow to cover them; the rows speculate this step."""
        decode = self.speculator.add_drafts(plan.decode, plan.draft_requests, drafts, self._rows, self.blocks)
        self._update_peak()
        return dataclasses.replace(plan, decode=decode, block_copies=plan.block_copies + self.blocks.take_copies(),
                                   window_copies=plan.window_copies + self.blocks.take_window_copies(),
                                   window_slots=self.blocks.window_slots(decode + plan.chunks),
                                   draft_requests=(), max_draft_tokens=0)

    def matcher(self, row_id: int) -> Any:
        """The grammar state of a constrained row (`ferrox_jax.grammar.RowMatcher`), for
        the owner thread's mask filling; None for an unconstrained row."""
        return self._rows[row_id].matcher

    def _apply_cancellations(self) -> None:
        self._expire_pending_cancels()
        for request_id in self._cancel_inbox:
            job = self._jobs.get(request_id)
            if job is None:
                self._pending_cancels[request_id] = self._clock()
                while len(self._pending_cancels) > MAX_PENDING_CANCELS:
                    self._pending_cancels.popitem(last=False)
            elif any(not row.state.is_finished for row in job.rows):
                self._stop_job(job, RowState.FINISHED_CANCELLED)
                self.aborted += 1
        self._cancel_inbox.clear()

    def _expire_pending_cancels(self) -> None:
        deadline = self._clock() - PENDING_CANCEL_TTL_S
        while self._pending_cancels and next(iter(self._pending_cancels.values())) < deadline:
            self._pending_cancels.popitem(last=False)

    def _admit_waiting(self) -> None:
        """Admits from the head while rows and ledger allow; a head that does not fit waits
        and holds the line (no skip-ahead, so no starvation), unless the priority policy
        preempts a less urgent running job for it (`_make_room`)."""
        while self._waiting:
            job = self._waiting[0]
            if self.num_running_rows + job.num_open_rows > self.limits.max_rows:
                if self._make_room(job):
                    continue
                return
            refusal = self.adapter_refusal(job.submitted)
            if refusal is not None:  # never: it ends, and the next job is the head
                code, message = refusal
                self._stop_job(job, RowState.FINISHED_ERROR, message, code)
                continue
            if not (self.blocks.try_resume(job, self._open_rows(job)) if job.has_forked
                    else self.blocks.try_admit(job)):
                if self._make_room(job):
                    continue
                return
            self._waiting.popleft()
            self.states.acquire(row.row_id for row in self._open_rows(job))  # until each row ends or is preempted
            # held until its last row ends (_flush_finished), a preemption included
            if job.submitted.adapter_name is not None and not job.adapter_slot:
                job.adapter_slot = self._adapters.acquire(job.submitted.adapter_name).slot
            self.num_admitted += not job.num_preemptions  # a job, not its re-admissions
            job.queue_s = (job.queue_s or 0.0) + self._clock() - job.queued_at_s
            if job.has_forked:
                self._resume(job)
            elif job.is_prefilled:  # n > 1 and nothing before the last prompt token to compute
                self._start_decoding(job)
            else:
                for row in job.rows:
                    transition(row, RowState.PREFILLING, self.state_counts)
                self._prefilling.append(job)

    def adapter_refusal(self, submitted: Job) -> tuple[str, str] | None:
        """(code, message) when the job's named adapter refuses it now (`ferrox_jax/admission.py`);
        None for the base model. Any thread (submit asks too): it only reads the registry."""
        name = submitted.adapter_name
        if name is None:
            return None
        if self._adapters is None:
            return "adapter_not_found", f"no LoRA adapter named {name!r} is loaded (this engine has no LoRA slots)"
        return self._adapters.refusal(name, submitted.adapter_key)

    def _plan_chunks(self, is_idle: bool) -> tuple[RowPlan, ...]:
        """Prompt chunks within the step's token budget, round robin: the front jobs get one
        chunk each, and a job whose prompt is not done goes to the back."""
        limits = self.limits
        cap = limits.idle_chunk_tokens if is_idle else limits.max_chunk_tokens
        budget = max(limits.batched_tokens, cap)
        chunks = []
        for job in list(self._prefilling)[:limits.max_chunks]:
            if budget <= 0:
                break
            row = job.resume_rows[0] if job.resume_rows else None  # a preempted row recomputing, one at a time
            start, target = ((job.num_computed_tokens, job.num_prefill_tokens) if row is None
                             else (row.num_computed_tokens, len(row.token_ids) - 1))
            end = self.blocks.recurrent.chunk_end(job, start, min(target, start + cap, start + budget))
            if job.submitted.images:  # an image's tokens attend to each other: never cut one
                end = chunk_end(job.submitted.images, start, end, cap)
            budget -= end - start
            chunks.append(self._plan_chunk(job, start, end) if row is None else self._plan_history_chunk(row, end))
            if end < target:  # a finished prompt leaves when its result is applied
                self._prefilling.remove(job)
                self._prefilling.append(job)
        return tuple(chunks)

    def _plan_chunk(self, job: JobState, start: int, end: int) -> RowPlan:
        prompt = job.submitted.prompt_token_ids
        self.blocks.prepare_prefill(job, start, end)
        is_last = end == job.num_prefill_tokens
        row = job.rows[0]
        # n > 1: each row samples on its own; a pooling job samples nothing
        sample = is_last and job.submitted.n == 1 and job.submitted.pooling is None
        return RowPlan(
            row_id=row.row_id, token_ids=prompt[start:end], start_pos=start,
            block_ids=tuple(job.prefill_block_ids), sample=sample,
            sampling=row.step_sampling(self._eos_token_ids), prompt_logprobs=job.submitted.prompt_logprobs,
            next_token_id=prompt[end] if end < len(prompt) else -1,
            num_prompt_tokens=len(prompt),
            history_token_ids=row.penalty_history(self._eos_token_ids) if sample else (),
            is_constrained=sample and row.matcher is not None, pooling=job.submitted.pooling is not None,
            adapter_slot=job.adapter_slot, state_slot=self.states.slot(row.row_id),
            images=overlapping(job.submitted.images, start, end), rope_images=rope_images(job.submitted.images))

    def _plan_decode_rows(self) -> tuple[RowPlan, ...]:
        """One token for every decoding row (under the priority policy, every row not less
        urgent than a prompt being prefilled: `_yields_to_prefill`)."""
        steps = []
        for row in self._decoding.values():
            if self._yields_to_prefill(row):
                continue
            pos = row.num_computed_tokens
            assert pos == len(row.token_ids) - 1, f"row {row.row_id} has no token to compute"
            self.blocks.prepare_decode(row)
            steps.append(RowPlan(
                row_id=row.row_id, token_ids=(row.token_ids[pos],), start_pos=pos,
                block_ids=tuple(row.block_ids), sample=True, sampling=row.step_sampling(self._eos_token_ids),
                num_prompt_tokens=len(row.job.submitted.prompt_token_ids),
                history_token_ids=row.penalty_history(self._eos_token_ids), is_constrained=row.matcher is not None,
                adapter_slot=row.job.adapter_slot, state_slot=self.states.slot(row.row_id),
                rope_images=rope_images(row.job.submitted.images)))
        return tuple(steps)

    def _update_peak(self) -> None:
        # Deliberately measured from the rows themselves rather than derived from the
        # budget: a ledger-derived peak cannot exceed the budget however broken admission is.
        num_held = len(self.blocks.held_block_ids(self._prefilling, self._rows_with_tables()))
        assert num_held == self.budget.num_held_blocks, (
            f"tables hold {num_held} blocks but the pool handed out {self.budget.num_held_blocks}")
        num_owed = sum(job.num_owed_blocks for job in self._jobs.values())
        assert num_owed == self.budget.num_owed_blocks, (
            f"jobs are owed {num_owed} blocks but the ledger promised {self.budget.num_owed_blocks}")
        self.kv_blocks_peak = max(self.kv_blocks_peak, num_held)

    # -- applying results --------------------------------------------------------------

    def check_output(self, plan: StepPlan, out: StepOutput) -> None:
        """Raises ValueError if the step left out a result the plan asked for."""
        wanted = [s.row_id for s in plan.rows if s.sample or s.prompt_logprobs or s.pooling]
        missing = [row_id for row_id in wanted if row_id not in out.results]
        if missing:
            raise ValueError(f"runner returned no result for rows {missing}")

    def update(self, plan: StepPlan, out: StepOutput) -> None:
        """Applies a step's results (steps 8-9 of the module docstring)."""
        for step in plan.chunks:
            self._apply_chunk(step, out.results.get(step.row_id))
        for step in plan.decode:
            row = self._rows[step.row_id]
            result = out.results[step.row_id]
            # A speculating row's accepted tokens follow its first, each applied as if
            # sampled in a step of its own (stops, max_tokens, stop strings stay exact).
            # A token the row replaced (its thinking budget's marker) ends the run: the
            # tokens verified after it followed the token it replaced.
            for token in (result, *result.following):
                row.num_computed_tokens += 1
                self.blocks.name_row_blocks(row)
                self._accept_token(row, token)
                if row.state.is_finished or row.took_forced_token:
                    break
            if step.num_draft_tokens:
                self.speculator.record(step, result, row.state.is_finished)
        self.prefill_chunks += len(plan.chunks)
        self.prefill_tokens += sum(len(step.token_ids) for step in plan.chunks)
        self.decode_steps += bool(plan.decode)
        for row_id in self._planned_row_ids:
            row = self._rows.get(row_id)
            if row is not None and not row.state.is_finished and row.new_token_ids:
                self._events.append(row.take_event())
        self._planned_row_ids = ()
        self._flush_finished()

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """Ends every job with a row in the failed step with an error; frees their blocks."""
        assert {s.row_id for s in plan.rows} <= set(self._planned_row_ids), (
            "fail_step() got a plan other than the last one scheduled")
        jobs = {self._rows[row_id].job.submitted.request_id: self._rows[row_id].job
                for row_id in self._planned_row_ids if row_id in self._rows}
        for job in jobs.values():
            self._stop_job(job, RowState.FINISHED_ERROR, error)
            self.num_failed_jobs += 1
        self.blocks.forget_failed_saves(plan.kv_saves, plan.state_copies)
        self._planned_row_ids = ()
        self._flush_finished()

    def fail_rows(self, plan: StepPlan, row_ids: Sequence[int], error: str, code: str | None = None) -> StepPlan:
        """Ends the jobs owning `row_ids` (rows of the last scheduled step whose results are
        unusable: non-finite logits) with an error (`code`: its kind, on the event) and frees their
        blocks; returns the plan without any row of those jobs, for `update` to apply to the step's
        other rows. Their blocks written this step are never named in the prefix cache."""
        jobs = {self._rows[row_id].job.submitted.request_id: self._rows[row_id].job
                for row_id in row_ids if row_id in self._rows}
        failed = {row.row_id for job in jobs.values() for row in job.rows}
        for job in jobs.values():
            self._stop_job(job, RowState.FINISHED_ERROR, error, code)
            self.num_failed_jobs += 1
        self._planned_row_ids = tuple(row_id for row_id in self._planned_row_ids if row_id not in failed)
        return dataclasses.replace(plan, decode=tuple(r for r in plan.decode if r.row_id not in failed),
                                   chunks=tuple(r for r in plan.chunks if r.row_id not in failed))

    def _apply_chunk(self, step: RowPlan, result: RowResult | None) -> None:
        job = self._rows[step.row_id].job
        if job.resume_rows:
            self._apply_history_chunk(self._rows[step.row_id], step)
            return
        job.num_computed_tokens += len(step.token_ids)
        self.blocks.name_prefill_blocks(job)
        if job.submitted.prompt_logprobs and result is not None:
            job.prompt_logprobs.extend(result.prompt_logprobs)
        if job.submitted.pooling is not None:
            self._pool_chunk(job, result)
            return
        if not job.is_prefilled:
            return
        self._prefilling.remove(job)
        self._start_decoding(job)
        if step.sample:
            self._accept_token(job.rows[0], result)

    def _pool_chunk(self, job: JobState, result: RowResult) -> None:
        """A pooling job (embeddings): add the chunk's hidden states; after its last chunk it
        ends with the pooled vector (mean over the prompt, or its last token's state), having
        sampled nothing; its prompt blocks are freed like any finished job's."""
        job.hidden_sum = result.hidden_sum if job.hidden_sum is None else job.hidden_sum + result.hidden_sum
        if not job.is_prefilled:
            return
        self._prefilling.remove(job)
        job.pooled = job.hidden_sum / job.num_prefill_tokens if job.submitted.pooling == "mean" else result.last_hidden
        self._finish_row(job.rows[0], RowState.FINISHED_STOP)

    def _start_decoding(self, job: JobState) -> None:
        """Hands the prefill's blocks to the rows (`BlockTables.fork`) and starts them."""
        self.blocks.fork(job)
        for row in job.rows:
            row.num_computed_tokens = job.num_prefill_tokens
            transition(row, RowState.DECODING, self.state_counts)
            self._decoding[row.row_id] = row

    def _accept_token(self, row: Row, result: RowResult) -> None:
        """The row takes a sampled token (`Row.accept_token`: its stop checks, grammar and
        text); the scheduler counts it, and queues the row's release if it ended."""
        self.tokens_generated += 1
        ended = row.accept_token(result, self._eos_token_ids, self.state_counts)
        if ended is None:
            return
        self.num_grammar_errors += ended is RowState.FINISHED_ERROR  # only the grammar's rejection ends it so
        self._to_flush.append(row)

    # -- ending rows -------------------------------------------------------------------

    def fail_adapter_jobs(self, slot: int, error: str, code: str) -> None:
        """Ends every open job holding adapter `slot` (its adapter was quarantined) with an
        error; rows of the last scheduled step must have gone through `fail_rows` first."""
        for job in [job for job in self._jobs.values() if job.adapter_slot == slot]:
            if any(not row.state.is_finished for row in job.rows):
                self._stop_job(job, RowState.FINISHED_ERROR, error, code)
                self.num_failed_jobs += 1

    def _stop_job(self, job: JobState, state: RowState, error: str | None = None, code: str | None = None) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._prefilling:
            self._prefilling.remove(job)
        for row in job.rows:
            if not row.state.is_finished:
                self._finish_row(row, state, error, code)

    def _finish_row(self, row: Row, state: RowState, error: str | None = None, code: str | None = None) -> None:
        row.finish(state, self.state_counts, error, code)
        self._to_flush.append(row)

    def _flush_finished(self) -> None:
        """Releases finished rows' blocks and state slots (and their jobs' once all ended), sends their last event."""
        rows, self._to_flush = self._to_flush, []
        for row in rows:
            self._decoding.pop(row.row_id, None)
            del self._rows[row.row_id]
            self.blocks.release_row(row)
            self.states.release((row.row_id,))
            if row.job.num_open_rows == 0:
                del self._jobs[row.job.submitted.request_id]
                if row.job.adapter_slot:  # the job's last row: its adapter's slot is free of it
                    self._adapters.release(row.job.adapter_slot)
            self._events.append(row.take_event())
