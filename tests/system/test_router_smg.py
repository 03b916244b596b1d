"""Two `ferrox serve` replicas behind SGLang's model gateway (`smg`, the PyPI package, a
dev dependency) on loopback: the gateway recognises them as vLLM-like workers, every
request it routes is answered, and its cache-aware policy keeps the prefix-cache hit rate
near what one replica alone reaches on the same kind of traffic, above round robin's.

The runs and the traffic are `tools/bench/bench_router.py`'s (its docstring says how the hit
rate is counted); docs/benchmarks.md has a larger run of the same tool."""

from __future__ import annotations

import pytest

from tests.support.server_harness import api_checkpoint, free_port
from tools.bench.bench_router import compare, ferrox_replicas, smg_binary

pytestmark = pytest.mark.skipif(smg_binary() is None, reason="smg (a dev dependency) is not installed")

USERS, TURNS = 5, 3  # 15 requests a run, three runs


def test_cache_aware_routing_keeps_the_single_replica_hit_rate(tmp_path):
    workers_seen: list[dict] = []
    with ferrox_replicas(str(api_checkpoint()), [free_port(), free_port()], tmp_path) as urls:
        results = compare(urls, free_port(), tmp_path, USERS, TURNS, seed=11, workers_seen=workers_seen)
    for listing in workers_seen:
        workers = {w["url"]: w for w in listing["workers"]}
        assert set(workers) == set(urls), listing
        for worker in workers.values():
            assert worker["is_healthy"] is True, worker
            assert worker["runtime_type"] == "vllm", f"/version makes it a vLLM-like worker: {worker}"
    for name, run in results.items():
        assert run["answered"] == run["requests"] == USERS * TURNS, (name, run)
    cache_aware, round_robin, alone = (results[k]["hit_rate"] for k in ("cache_aware", "round_robin", "one_replica"))
    assert cache_aware >= 0.9 * alone, f"cache-aware {cache_aware:.3f} within 10 % of one replica's {alone:.3f}"
    assert cache_aware > round_robin, f"cache-aware {cache_aware:.3f} above round robin's {round_robin:.3f}"
