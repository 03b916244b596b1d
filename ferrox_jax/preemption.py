"""Preemption: how the scheduler gives a running job's place to a more urgent one. No jax here.

The scheduler's half that the priority policy (`ferrox_jax/priority.py`: queue order, which
job gives way, the starvation guard) drives; `Scheduler` inherits it and only it calls it,
on the owner thread. Under "fcfs" `_make_room` answers False at once and nothing here runs.

    _make_room(head)   the waiting head does not fit: preempt the least urgent running job
                       that may give way, if preempting all of those would make room
    _preempt(job)      free its blocks and promises (`BlockTables.preempt`), its open rows
                       -> WAITING with their output, back in the waiting queue
    _resume(job)       re-admitted (`BlockTables.try_resume` took its cached blocks): rows
                       with tokens to recompute -> PREFILLING, the others -> DECODING
    _yields_to_prefill(row)
                       while a job prefills (an urgent arrival), decoding rows of a less
                       urgent level skip their step: the prompt's chunks run alone (the
                       larger idle chunk), so its first token is not behind theirs
    _plan_history_chunk / _apply_history_chunk
                       a recomputing row's prompt and output, chunk by chunk into its own
                       blocks, sampling nothing; then it decodes again

Why the reply is unchanged: a row keeps its output life (text stream, stop strings, grammar
state, seed, speculation counters); it recomputes every position it had computed, and its
next token is drawn by an ordinary decode step at the same position, with noise keyed by
(seed, position) (`ferrox_jax/sampling.py`), so greedy and seeded rows sample what they
would have. Nothing it already streamed is sent again: preemption happens in `schedule()`,
after the previous tick's events were taken, and recomputing adds no token.
"""

from __future__ import annotations

from ferrox_jax.images import overlapping, rope_images
from ferrox_jax.plan import RowPlan
from ferrox_jax.priority import pick_victim
from ferrox_jax.request import JobState, Row
from ferrox_jax.row_state import RowState, transition


class Preemption:
    """The scheduler's preemption methods (module docstring); mixed into `Scheduler`."""

    @staticmethod
    def _open_rows(job: JobState) -> list[Row]:
        return [row for row in job.rows if not row.state.is_finished]

    def _make_room(self, head: JobState) -> bool:
        """Under the priority policy, preempts the least urgent running job that may give way
        to `head` (`ferrox_jax/priority.py:pick_victim`) if preempting every such job would
        free the rows and blocks `head` needs; True when it preempted one (admission retries)."""
        if not self._preempts:
            return False
        running = {id(job): job for job in self._prefilling}
        running.update((id(row.job), row.job) for row in self._decoding.values())
        victims = [job for job in running.values() if pick_victim(head, [job]) is job]
        num_rows = self.num_running_rows - sum(self._num_rows_held(job) for job in victims) + head.num_open_rows
        num_blocks = self.budget.num_free_blocks + sum(
            self.blocks.num_releasable(job, self._held_rows(job)) for job in victims)
        if not victims or num_rows > self.limits.max_rows or num_blocks < self._num_blocks_wanted(head):
            return False  # head waits, holding the line, as under fcfs
        self._preempt(pick_victim(head, victims))
        return True

    def _num_blocks_wanted(self, job: JobState) -> int:
        """What `job`'s admission would charge now (`BlockTables.admission_cost`). Its hits
        on a victim's blocks count as free (they go idle) though they would cost one each
        once idle: an estimate that errs towards preempting, which only costs a recompute."""
        return self.blocks.admission_cost(job, self._open_rows(job))

    def _num_rows_held(self, job: JobState) -> int:
        """Rows a running job holds: all n while its prompt prefills, else its rows with tables."""
        return job.submitted.n if job in self._prefilling and not job.resume_rows else len(self._held_rows(job))

    def _held_rows(self, job: JobState) -> list[Row]:
        """A running job's rows holding a table: decoding, or recomputing after a preemption."""
        return [row for row in job.rows if row.row_id in self._decoding or row in job.resume_rows]

    def _preempt(self, job: JobState) -> None:
        """Frees a running job's blocks and puts it back in the waiting queue under its
        original urgency; its rows keep their output and recompute it when re-admitted."""
        self.num_preemptions += 1
        job.num_preemptions += 1
        if job in self._prefilling:
            self._prefilling.remove(job)
        rows = self._open_rows(job)
        job.has_forked = job.has_forked or any(row.state is RowState.DECODING for row in rows)
        for row in rows:
            self._decoding.pop(row.row_id, None)
            transition(row, RowState.WAITING, self.state_counts)
        self.blocks.preempt(job, rows)
        # re-admitted, a row recomputes from position 0, where its recurrent state starts at zeros
        self.states.release(row.row_id for row in rows)
        job.resume_rows, job.prompt_logprobs, job.hidden_sum = [], [], None  # recomputed whole
        job.queued_at_s = self._clock()
        self._waiting.append(job)

    def _resume(self, job: JobState) -> None:
        """A re-admitted job whose rows had decoded: rows with output to recompute prefill it
        (`_plan_history_chunk`); a row the prefix cache gave all of it decodes at once."""
        job.resume_rows = [row for row in self._open_rows(job) if row.num_computed_tokens < len(row.token_ids) - 1]
        for row in self._open_rows(job):
            if row in job.resume_rows:
                transition(row, RowState.PREFILLING, self.state_counts)
            else:
                transition(row, RowState.DECODING, self.state_counts)
                self._decoding[row.row_id] = row
        if job.resume_rows:
            self._prefilling.append(job)

    def _yields_to_prefill(self, row: Row) -> bool:
        """Under the priority policy, True for a decoding row less urgent (a strictly higher
        priority value) than a job in the prefilling queue: it skips this step, which changes
        when its tokens come, never which (its draws are keyed by seed and position)."""
        if not self._preempts or not self._prefilling:
            return False
        return row.job.submitted.priority > min(job.submitted.priority for job in self._prefilling)

    def _plan_history_chunk(self, row: Row, end: int) -> RowPlan:
        """A preempted row recomputing its tokens (prompt and output) up to `end`, into its
        own blocks; it samples nothing: its next token is drawn by its next decode step."""
        start = row.num_computed_tokens
        self.blocks.prepare_decode(row, end - start)
        return RowPlan(row_id=row.row_id, token_ids=tuple(row.token_ids[start:end]), start_pos=start,
                       block_ids=tuple(row.block_ids), sample=False, sampling=row.sampling,
                       num_prompt_tokens=len(row.job.submitted.prompt_token_ids), adapter_slot=row.job.adapter_slot,
                       state_slot=self.states.slot(row.row_id), images=overlapping(row.job.submitted.images, start, end),
                       rope_images=rope_images(row.job.submitted.images))

    def _apply_history_chunk(self, row: Row, step: RowPlan) -> None:
        """A recomputing row's chunk ran; once all but its last token are back in its
        blocks it decodes again (and its job leaves the prefilling queue with its last)."""
        job = row.job
        row.num_computed_tokens += len(step.token_ids)
        self.blocks.name_row_blocks(row)
        if row.num_computed_tokens < len(row.token_ids) - 1:
            return
        job.resume_rows.remove(row)
        transition(row, RowState.DECODING, self.state_counts)
        self._decoding[row.row_id] = row
        if not job.resume_rows:
            self._prefilling.remove(job)

