"""models/reference.py: the reference logits' file format and the metrics that judge a
model's logits against them, which tests and tools/parity/compare_logits.py share. Pure numpy:
every expectation here is computed by hand in the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.reference import (PromptReference, common_prefix_len, compare_prompt, format_report,
                              kl_divergence, load_reference, log_softmax, save_reference, to_top_k,
                              tolerance_failures)

REPO = Path(__file__).resolve().parents[2]


def test_log_softmax_normalises_and_ignores_a_constant_offset():
    x = np.array([[1.0, 2.0, 3.0], [1001.0, 1002.0, 1003.0]], np.float32)
    out = log_softmax(x)
    assert out.dtype == np.float64
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(out[0], out[1], atol=1e-12)  # no overflow at 1003: max subtracted first


def test_kl_of_a_distribution_with_itself_is_zero_and_a_two_point_case_matches_by_hand():
    p = np.log([[0.5, 0.5]])
    q = np.log([[0.75, 0.25]])
    assert kl_divergence(p, p)[0] == 0.0
    # 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 (ln 2/3 + ln 2) = 0.5 ln 4/3
    assert kl_divergence(p, q)[0] == pytest.approx(0.5 * np.log(4 / 3), rel=1e-12)


def test_tokens_the_reference_rules_out_add_nothing_rather_than_nan():
    ref = log_softmax(np.array([[0.0, -np.inf, 0.0]]))
    ours = log_softmax(np.array([[0.0, 5.0, 0.0]]))
    kl = kl_divergence(ref, ours)
    assert np.isfinite(kl).all()
    # ours gives each of the two live tokens 1 / (2 + e^5); KL = ln((1/2) / (1 / (2 + e^5)))
    assert kl[0] == pytest.approx(np.log((2 + np.exp(5.0)) / 2), rel=1e-12)


def test_full_logit_comparison_reports_max_abs_top1_and_the_greedy_prefix():
    ref = PromptReference([7, 8], logits=np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]], np.float32),
                          greedy_ids=[1, 2, 3, 4])
    ours = np.array([[0.0, 1.0, 0.5], [0.0, 0.0, 2.0]], np.float32)  # position 1's argmax moved: 0 -> 2
    report = compare_prompt(ref, ours, [1, 2, 9, 4])
    assert report.max_abs == 2.0 and report.top1 == 0.5
    assert (report.greedy_match, report.greedy_tokens) == (2, 4), "greedy match stops at the first difference"
    assert report.reference_kind == "logits" and report.num_tokens == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_a_shape_mismatch_is_a_value_error_naming_both_sides():
    ref = PromptReference([7], logits=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(1, 3\) and ours \(1, 4\)"):
        compare_prompt(ref, np.zeros((1, 4), np.float32), None)


def test_tolerances_fail_on_nan_and_on_a_missing_greedy_continuation():
    ref = PromptReference([7], logits=np.zeros((1, 3), np.float32))
    report = compare_prompt(ref, np.array([[np.nan, 0.0, 0.0]], np.float32), None)
    failures = tolerance_failures(report, max_abs=1.0, min_greedy_match=1)
    assert len(failures) == 2 and "greedy match asked for" in failures[1]
    assert tolerance_failures(compare_prompt(ref, np.zeros((1, 3), np.float32), None), max_abs=0.0) == []
    assert "FAIL: " in format_report(0, report, failures)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_reference_files_round_trip_full_logits_and_top_k(tmp_path, suffix):
    logits = np.random.RandomState(0).randn(3, 6).astype(np.float32)
    full = PromptReference([1, 2, 3], text="abc", logits=logits, greedy_ids=[4, 5])
    top = to_top_k(PromptReference([9, 8, 7], logits=logits), 2)
    path = tmp_path / f"ref{suffix}"
    save_reference(path, [full, top])
    back_full, back_top = load_reference(path)
    np.testing.assert_array_equal(back_full.logits, logits)
    assert (back_full.token_ids, back_full.text, back_full.greedy_ids) == ([1, 2, 3], "abc", [4, 5])
    assert back_top.kind == "top-2" and back_top.greedy_ids is None
    np.testing.assert_array_equal(back_top.top_ids, np.argsort(-logits, axis=-1, kind="stable")[:, :2])


def test_a_malformed_file_is_a_value_error_naming_the_prompt(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "ferrox-logits-reference", "version": 1,
                               "prompts": [{"token_ids": [1, 2], "logits": [[0.0, 1.0]]}]}))  # 1 row for 2 ids
    with pytest.raises(ValueError, match="prompt 0"):
        load_reference(bad)
    with pytest.raises(ValueError, match="must end in .json or .npz"):
        load_reference(tmp_path / "ref.txt")


def test_importing_the_library_loads_no_heavy_dependency():
    code = ("import sys, models.reference; "
            "print(sorted(m for m in ('jax', 'flax', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"models.reference pulled in {out.stdout.strip()} at import"
