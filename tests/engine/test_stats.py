"""BatcherStats, the snapshot the engine publishes: its step-fault fields are the fault
kinds of ferrox_jax/step_faults.py, one each, so `/health` and `/metrics` list them from
the snapshot alone."""

from __future__ import annotations

from ferrox_jax.stats import BatcherStats
from ferrox_jax.step_faults import FAULT_KINDS


def test_step_faults_by_kind_counts_every_fault_kind_in_order():
    stats = BatcherStats(step_faults_exception=2, step_faults_timeout=1)
    assert stats.step_faults_by_kind() == {**dict.fromkeys(FAULT_KINDS, 0), "exception": 2, "timeout": 1}
    assert tuple(stats.step_faults_by_kind()) == FAULT_KINDS, "one step_faults_<kind> field per fault kind"
