"""LoRA adapter slots under tensor parallelism on 2 simulated CPU devices (one subprocess,
tests/support/lora_sharding_probe.py, as tests/system/test_sharding.py runs its probe).

A tiny Llama (4 heads, 2 KV heads: both split over 2 devices) with two PEFT adapters on
every projection, served at tp=2 and at tp=1: a batch of both adapters' rows and a base
row, prefilled and decoded greedily together, must give the same logits and the same
tokens; and A/B must be split like the weights they modify (ferrox_jax/sharding.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import family_checks as fc
from tests.support.lora_helpers import CONFIGS, make_peft_adapter
from tests.support.xla_flags import with_devices

ROOT = Path(__file__).resolve().parents[2]
# float32 both sides; the split changes only the order of the partial sums of o_proj and
# down_proj (and of their adapters' x A), over 32 and 64 products per device.
ATOL = 1e-5
RANK_SLOTS = 8 * 3  # lora_runner's max_rank 8 x (2 adapters + the zero slot)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    base = fc.make_checkpoint(root / "base", CONFIGS["llama"]())
    adapters = [make_peft_adapter(base, root / "wide", seed=1, r=4, alpha=8.0),
                make_peft_adapter(base, root / "narrow", seed=2, r=8, alpha=4.0,
                                  targets=("q_proj", "o_proj", "down_proj"), use_rslora=True)]
    env = {**os.environ, "XLA_FLAGS": with_devices(2)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "lora_sharding_probe.py"), str(base),
                           *map(str, adapters)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"probe failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp2_adapted_and_base_rows_match_one_device(probed):
    rows = probed["rows"]
    assert [r["slot"] for r in rows] == [1, 2, 0], "two adapters and the base model in one batch"
    for r in rows:
        assert r["max_abs_err"] < ATOL, f"slot {r['slot']}: tp=2 logits differ from one device by {r['max_abs_err']}"
        assert r["same_greedy"], f"slot {r['slot']}: tp=2 greedy tokens differ from one device"


def test_adapter_stacks_are_split_like_their_weights(probed):
    place = probed["placement"]
    # q_proj [64, 4 heads x 16] and gate_proj [64, 128]: column-split, so B's outputs split
    # and A [64, 24] is whole on each device.
    assert place["q_proj"] == {"base": [[64, 32]], "a": [[64, RANK_SLOTS]], "b": [[RANK_SLOTS, 32]]}
    assert place["gate_proj"] == {"base": [[64, 64]], "a": [[64, RANK_SLOTS]], "b": [[RANK_SLOTS, 64]]}
    # o_proj [64, 64] and down_proj [128, 64]: row-split, so A's inputs split, B whole.
    assert place["o_proj"] == {"base": [[32, 64]], "a": [[32, RANK_SLOTS]], "b": [[RANK_SLOTS, 64]]}
    assert place["down_proj"] == {"base": [[64, 64]], "a": [[64, RANK_SLOTS]], "b": [[RANK_SLOTS, 64]]}
