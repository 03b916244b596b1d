"""Scheduling policy: the waiting queue's order, and which running job gives way. No jax here.

Two policies (`SchedulerLimits.scheduling_policy`, the server's `--scheduling-policy`):

  * "fcfs" (the default, the contract's order): jobs are admitted in arrival order, the
    head that does not fit holds the line, and nothing running is ever preempted. A job
    must then carry priority 0 (`check_priority`), as vLLM refuses a priority it would
    ignore.
  * "priority": the waiting queue is ordered by urgency, `(priority, arrival)`: the lower
    `Job.priority` first, first come first served within a level. When the most urgent
    waiting job cannot be admitted for lack of rows or KV blocks, the scheduler preempts
    running jobs for it, the least urgent first (`pick_victim`: highest priority value,
    then latest arrival), but only jobs of a strictly less urgent level: two jobs of one
    level never preempt each other, so they cannot take turns undoing each other's work.

Against vLLM's v1 scheduler: the victim is chosen alike (`max(running, key=(priority,
arrival))`), but vLLM preempts when a *running* request cannot allocate its next blocks, its
KV growing on demand; ferrox reserves each job's lifetime worst case at admission (the
contract's rule), so a running row never runs short and the decision moves to admission,
for the waiting head. And vLLM may preempt within a level; ferrox does not.

Preemption (`Scheduler._preempt`) frees every block the job holds and owes, puts it back
in the waiting queue under its original urgency, and it later recomputes from its prompt
plus the tokens it produced so far (`BlockTables.try_resume`: the prefix cache usually
still holds most of them, so the recompute is mostly lookups). Its rows keep their output
life (text, stop strings, grammar state, seeds); the row's next draw is keyed by (seed,
position) as before, so its reply is token for token the unpreempted one, and nothing it
already streamed is sent again.

While a job is in the prefilling queue, decoding rows of a strictly less urgent level skip
their steps (`Scheduler._yields_to_prefill`): an urgent prompt's chunks run alone, so its
first token comes about as soon as on an idle server instead of after a step of every
background row (docs/benchmarks.md, "Priority scheduling"). Skipping a step changes when a
row's tokens come, never which.

The starvation guard: a job preempted `MAX_PREEMPTIONS` times is never preempted again;
once re-admitted it runs to its end. So a low-priority job loses its work at most that
many times, however many urgent jobs arrive. (A low-priority job that is never admitted
while more urgent work keeps the server full waits, as in vLLM: strict priority has no
aging.)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from ferrox_jax.config import SCHEDULING_POLICIES  # noqa: F401 (named here for readers of the policy)
from ferrox_jax.request import PRIORITY_MAX, PRIORITY_MIN, JobState

# The starvation guard (module docstring): preemptions a job suffers at most.
MAX_PREEMPTIONS = 3


def check_priority(priority: object, policy: str, owner: str = "priority") -> str | None:
    """Why `priority` cannot be scheduled under `policy` (a message naming `owner`), or None.

    An integer in [PRIORITY_MIN, PRIORITY_MAX] (not a bool); under "fcfs" only 0, as vLLM
    refuses a priority that would be ignored."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"{owner} must be an integer; got {priority!r}"
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        return f"{owner} must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]; got {priority}"
    if priority != 0 and policy != "priority":
        return (f"{owner} {priority} needs priority scheduling; this server schedules first come first served "
                "(start it with --scheduling-policy priority, or send priority 0)")
    return None


def urgency(job: JobState) -> tuple[int, int]:
    """The sort key of the priority policy: lower first (priority, then arrival)."""
    return job.submitted.priority, job.arrival


class WaitingQueue:
    """Jobs waiting for admission, the head first: arrival order under "fcfs", urgency
    order under "priority" (a job re-queued by preemption keeps its place by urgency)."""

    def __init__(self, policy: str) -> None:
        self._by_urgency = policy == "priority"
        self._jobs: list[JobState] = []

    def append(self, job: JobState) -> None:
        if self._by_urgency:
            bisect.insort(self._jobs, job, key=urgency)
        else:
            self._jobs.append(job)

    def popleft(self) -> JobState:
        return self._jobs.pop(0)

    def remove(self, job: JobState) -> None:
        self._jobs.remove(job)

    def __getitem__(self, index: int) -> JobState:
        return self._jobs[index]

    def __contains__(self, job: object) -> bool:
        return job in self._jobs

    def __iter__(self) -> Iterator[JobState]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


def pick_victim(head: JobState, running: Iterable[JobState]) -> JobState | None:
    """The running job to preempt for `head`: the least urgent of those at a strictly less
    urgent level that the starvation guard still allows; None when there is none."""
    candidates = [job for job in running
                  if job.submitted.priority > head.submitted.priority and job.num_preemptions < MAX_PREEMPTIONS]
    return max(candidates, key=urgency, default=None)
