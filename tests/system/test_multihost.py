"""Multi-host serving on a local CPU cluster (tests/support/multihost_cluster.py): `ferrox
serve` as 2 processes (jax.distributed, gloo collectives, tensor parallel across them; the
followers configured by FERROX_* variables) answers the single-process greedy tokens of
the default model (SmolLM2-135M Q4_1; under tensor parallelism `--quantization auto`
resolves to float32 weights on every process, like the single-process reference) through
the HTTP API with no compile after warm-up; 4 processes of the tiny model do the same
(4-way: three followers), and every follower exits non-zero once the leader is killed.
Process 0 compiles every shape and the others load its executables
(`shared_compiles.SharedCompiles`, checked on the real key-value store in
tests/support/shared_compiles_probe.py: a follower exits non-zero on a different program or a
silent leader). A draft model speculates across 2 processes with the single-process tokens.

Failures, signals and the step channel's door are tests/system/test_multihost_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.multihost_cluster import (DEFAULT_LIMITS, PROMPTS, REPO, SECRET, TIMEOUT_S, TINY_LIMITS,
                                             check_shared_compiles, cluster, complete_all, reference_replies,
                                             tiny_reference_replies)
from tests.support.server_harness import api_checkpoint, free_port
from tests.support.xla_flags import with_devices

# The cluster harness lived here before it moved to tests/support/multihost_cluster.py: files
# that import it from this module keep working.
__all__ = ["DEFAULT_LIMITS", "PROMPTS", "REPO", "SECRET", "TIMEOUT_S", "TINY_LIMITS", "check_parity",
           "check_shared_compiles", "cluster", "complete_all"]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """One process, the default model's float32 weights (EngineConfig's quantization "none":
    what `--quantization auto` resolves to under tensor parallelism)."""
    return reference_replies("default", DEFAULT_LIMITS)


@pytest.fixture(scope="module")
def tiny_reference() -> list[dict]:
    return tiny_reference_replies()


def check_parity(urls: list[str], reference: list[dict], num_processes: int, num_prompts: int = len(PROMPTS),
                 concurrent: bool = False) -> None:
    leader, followers = urls[0], urls[1:]
    for i, follower in enumerate(followers, 1):
        assert httpx.get(follower + "/health").json() == {"state": "ready", "role": "follower", "process_id": i}
    assert httpx.get(followers[0] + "/v1/models").status_code == 404, "a follower serves /health only"
    card = httpx.get(leader + "/v1/models").json()["data"][0]
    assert card["quantization"] == "none", "auto -> float weights: GGUF blocks have no sharding rule"
    got = complete_all(leader, concurrent=concurrent, prompts=PROMPTS[:num_prompts])
    assert got == reference[:num_prompts], f"tp{num_processes} across {num_processes} processes: one process's tokens"
    metrics = httpx.get(leader + "/metrics").text
    assert "ferrox_recompiles_after_warmup_total 0.0" in metrics, "no compile after warm-up"


@pytest.mark.slow
def test_two_processes_give_the_single_process_greedy_tokens_of_the_default_model(tmp_path, reference):
    # SmolLM2-135M has 3 KV heads: tensor parallelism splits the MLP and the vocabulary.
    with cluster(2, tmp_path, "default", DEFAULT_LIMITS, ("--replicate-attention",)) as (urls, _):
        check_parity(urls, reference, 2)
    check_shared_compiles(tmp_path, 2)


def test_four_processes_give_the_single_process_greedy_tokens(tmp_path, tiny_reference):
    # 4-way on the tiny checkpoint: the MLP (128 = 4 x 32) and the vocabulary (384 = 4 x 96)
    # split, attention replicated (2 KV heads do not divide by 4), as the default model is
    # at 2 processes above; three followers load process 0's executables. The default model
    # adds no mechanism here and cost ~90 s (a 4-process step of its 30 layers takes ~1 s,
    # ~60 gloo all-reduces, on 2 shared cores); the tiny one answers all three prompts, two
    # at a time (decode steps of 2 rows).
    with cluster(4, tmp_path, extra=("--replicate-attention",)) as (urls, procs):
        check_parity(urls, tiny_reference, 4, concurrent=True)
        procs[0].send_signal(signal.SIGKILL)  # the leader dies: every follower exits too, non-zero
        for follower in procs[1:]:
            assert follower.wait(30) != 0, "a follower without its leader exits non-zero"
    check_shared_compiles(tmp_path, 4)


def run_probe(case: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """tests/support/shared_compiles_probe.py's `case` in a process of its own (a group of one)."""
    probe = REPO / "tests" / "support" / "shared_compiles_probe.py"
    cmd = [sys.executable, str(probe), str(free_port()), case, str(cache_dir)]
    # One CPU device, as `cluster` pins it: the suite's environment may carry another count.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "XLA_FLAGS": with_devices(1)})


def test_a_follower_loads_what_a_slow_leader_compiled(tmp_path):
    done = run_probe("roundtrip", tmp_path)  # a fresh persistent cache: the first compile is a real one
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    # v = 0..7: v.sum() + (2 v + 1).sum() + 4 * 8 * v[0] = 28 + (56 + 8) + 0 = 92
    assert got["leader"] == got["follower"] == 92.0, "the loaded executable computes what the compiled one does"
    assert got["waited_s"] >= 3.0, "the follower waited out the leader's 3 s (3 of its 1 s timeouts) without failing"
    assert [k for k in got["keys"] if "step" in k] == ["ferrox/compiled/step#0", "ferrox/compiled/step#1",
                                                        "ferrox/compiled/step#2"]
    # The leader's second compile is a cache read, whose serialization would fail to run
    # elsewhere: it publishes the digest alone (32 bytes) and the follower compiles.
    assert got["second_bytes"] == 32 and got["second"] == [92.0, 92.0]
    assert "process 0 read it from its compilation cache" in done.stderr
    # The third is that cache read handed back from memory, without an event: its payload
    # has no object code, so the digest alone again (published, the follower's run failed).
    assert got["third_bytes"] == 32 and got["third"] == [92.0, 92.0]
    assert "came from memory without object code" in done.stderr


def test_a_follower_refuses_a_different_program_under_the_same_name(tmp_path):
    done = run_probe("mismatch", tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "process 0 compiled a different program for step" in done.stderr


def test_a_follower_waiting_for_a_silent_leader_exits_non_zero(tmp_path):
    t0 = time.monotonic()
    done = run_probe("hung", tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "no compile heartbeat from process 0 for 1 s" in done.stderr
    assert time.monotonic() - t0 < 60, "bounded by the 1 s timeout (plus the start-up), not a hang"


def test_a_draft_model_speculates_across_two_processes(tmp_path, tiny_reference):
    """`--speculative draft` on a 2-process group: the draft's weights and KV cache are
    sharded over both processes as the target's are, the leader sends each proposal step to
    the follower (`multihost.DraftSender`), and the replies are the single-process
    non-speculative ones. The tiny checkpoint drafts for itself, so every greedy draft is
    kept: a follower whose draft cache fell out of step would break that (or the step)."""
    extra = ("--speculative", "draft", "--draft-model", str(api_checkpoint()), "--num-speculative-tokens", "3",
             "--speculative-max-rows", "2")
    with cluster(2, tmp_path, extra=extra) as ((leader, _), procs):
        assert complete_all(leader, concurrent=True) == tiny_reference, "drafted tp2 across 2 processes"
        stats = httpx.get(leader + "/admin/stats").json()
        assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
        assert "ferrox_recompiles_after_warmup_total 0.0" in httpx.get(leader + "/metrics").text
        assert all(proc.poll() is None for proc in procs)
    assert "Traceback" not in (tmp_path / "process-1.log").read_text(), "the follower ran every draft step it was sent"

