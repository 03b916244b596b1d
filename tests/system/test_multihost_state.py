"""Multi-host serving of a model with recurrent state: a tiny random Qwen3.5
(tests/support/family_checks.make_tiny_qwen3_5) as `ferrox serve` in 2 processes, tensor
parallel across them (tests/system/test_multihost.py's `cluster`), answers what one process
answers.

Under tensor parallelism each process holds its own DeltaNet heads' part of the state pool
(models/deltanet.py), so every state copy must run on every process: a prefix hit's snapshot
save and restore and the n > 1 fork travel in the step's host batch (`HostBatch.state_copies`,
run before the forward by the block-copy executable), which the leader sends each follower
before the forward. A follower that missed one would compute its heads from another state and
the all-reduced output would change the tokens (tests/models/test_state_prefix_qwen3_5.py's
negative controls show a missing restore or fork changes them on one process). The requests:
A = X + 3 tokens (its snapshot at 12, the end of the 3-block prefix X), then B = X + 9 tokens
with n = 2, seeded sampling: a hit on X restoring A's snapshot, and a fork of the prefill row's
state to the second row. Each choice's tokens, and the cached tokens, equal the single-process
engine's; nothing compiles after warm-up.

A group does not sleep: `POST /sleep` on the leader is a 400 `unsupported` before anything is
freed, and the same requests then hit their snapshots (before, the leader emptied its prefix
cache, its runner then refused the release and the route answered a 500: the cached tokens
would be 0).

Negative control, in the same cluster: the follower runs under tests/support/fault_serve.py with
a `StateCopyDropper` (tests/support/faults.py), armed once the second round is answered; a third
round of the same requests (each a hit again: restores and the fork, all state copies) then runs
with the follower's copies voided, and its tokens differ from one process's. So the equality
above holds because the copies ride the step to the follower, not because its states do not
matter.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support import family_checks as fc
from tests.support.faults import DROP_STATE_COPIES_ENV
from tests.support.server_harness import ServerThread, tiny_engine
from tests.system.test_multihost import cluster

# Blocks of 4 (X is 3 of them), 2 rows (n = 2), one 16-token chunk: few shapes to compile.
# 8 snapshot slots (two per row would be 4): every prompt's and reply's snapshot stays, so the hits
# below test what the group carries, not which snapshot a full pool gives up (its own tests)
LIMITS = dict(block_size=4, kv_blocks=64, max_context=96, max_seqs=2, prefill_chunk=16, max_queue=4, state_snapshots=8)
PREFIX = 12


def _tokens(seed, n):
    return np.random.RandomState(seed).randint(0, 250, n).tolist()


def requests(url: str) -> list[dict]:
    """A, then B with n = 2 (module docstring); per request its choices' (text, tokens) and its cached tokens."""
    x = _tokens(0, PREFIX)
    bodies = [dict(prompt=x + _tokens(1, 3), max_tokens=2, temperature=0),
              dict(prompt=x + _tokens(2, 9), max_tokens=8, temperature=0.9, seed=7, n=2)]
    out = []
    for body in bodies:
        r = httpx.post(url + "/v1/completions", timeout=300, json={**body, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        reply = r.json()
        out.append({"choices": [(c["text"], c["logprobs"]["tokens"]) for c in reply["choices"]],
                    "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"]})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")


@pytest.mark.slow
def test_two_processes_serve_a_prefix_hit_and_n_2_as_one_process(checkpoint, tmp_path):
    with ServerThread(create_app(tiny_engine(checkpoint, quantization="none", **LIMITS), ServerConfig())) as url:
        reference = requests(url)
    assert [r["cached"] for r in reference] == [0, PREFIX], "B hits X and restores A's snapshot"
    first, second = reference[1]["choices"]
    assert first != second, "the two seeded choices differ (each row its own sampling noise)"
    drop_flag = tmp_path / "drop-state-copies"  # the follower voids its state copies while this exists
    with cluster(2, tmp_path, str(checkpoint), LIMITS,
                 follower_faults={DROP_STATE_COPIES_ENV: str(drop_flag)}) as (urls, procs):
        got = requests(urls[0])
        stats = httpx.get(urls[0] + "/admin/stats").json()
        metrics = httpx.get(urls[0] + "/metrics").text
        # A group does not sleep: refused in the envelope before anything is freed (the prefix
        # cache included: both prompts hit their snapshots again below).
        asleep = httpx.post(urls[0] + "/sleep", timeout=60)
        assert asleep.status_code == 400 and asleep.json()["error"]["code"] == "unsupported", asleep.text
        assert "multi-host group" in asleep.json()["error"]["message"]
        again = requests(urls[0])
        before_drop = (tmp_path / "process-1.log").read_text()
        drop_flag.touch()  # the negative control (module docstring)
        dropped = requests(urls[0])
        assert all(proc.poll() is None for proc in procs)
    # A hits its own snapshot at 12, B (21 tokens) its own at 20; the replies are the same again
    assert [r["cached"] for r in again] == [PREFIX, 20], "the refused sleep kept the prefix cache"
    assert [r["choices"] for r in again] == [r["choices"] for r in reference]
    assert got == reference, "tp2 across 2 processes: one process's tokens and cached tokens"
    assert stats["state_snapshots_restored"] == 1 and stats["state_snapshots_taken"] >= 1, stats
    assert "ferrox_recompiles_after_warmup_total 0.0" in metrics, "no compile after warm-up"
    follower_log = (tmp_path / "process-1.log").read_text()
    assert "Traceback" not in follower_log, "the follower ran every step it was sent"
    # The negative control: both requests hit again (2 restores, the fork, B's new save), but the
    # follower voided every state copy, so its DeltaNet heads ran from other states
    assert "TEST-ONLY: dropped" in follower_log and "TEST-ONLY: dropped" not in before_drop, \
        "the follower dropped state copies only once armed"
    assert [r["cached"] for r in dropped] == [PREFIX, 20], "the third round hits its snapshots too"
    assert [r["choices"] for r in dropped] != [r["choices"] for r in reference], \
        "without the state copies on the follower the group's tokens must differ from one process's"
