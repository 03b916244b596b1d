"""tools/parity/compare_logits.py on a tiny random HF checkpoint: it passes against HF and
against the reference files it writes, and fails on a corrupted file or an impossible
tolerance (the negative controls that show the exit status means something).

The tool's `main(argv)` runs in-process; one module-scoped HF run writes the reference
files every other test reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.parity import compare_logits as cl
from models import reference as lr

# Both sides float32 on the same weights: differences come only from summation order.
TIGHT = ["--max-abs", "1e-4", "--max-kl", "1e-8", "--min-top1", "1", "--min-greedy-match", "8"]
PROMPTS = ["--prompt", "The quick brown fox", "--prompt", "Hello world! How are you today?"]
GREEDY = ["--greedy-tokens", "8", "--block-size", "8", "--max-chunk-tokens", "16"]


@pytest.fixture(scope="module")
def saved(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoint, and HF reference files (full-logit npz, top-5 json) plus main's exit codes."""
    path = str(tiny_checkpoints("llama"))
    out = tmp_path_factory.mktemp("ref")
    npz, topk_json = out / "ref.npz", out / "ref_top5.json"
    rc_npz = cl.main(["--model", path, "--reference", "hf", "--save-reference", str(npz), "--chat",
                      *PROMPTS, *GREEDY, *TIGHT])
    rc_json = cl.main(["--model", path, "--reference", "hf", "--save-reference", str(topk_json), "--save-top-k", "5",
                       "--save-only", *PROMPTS, *GREEDY])
    return dict(path=path, npz=npz, topk_json=topk_json, rc_npz=rc_npz, rc_json=rc_json, dir=out)


def test_passes_against_hf_transformers(saved):
    assert saved["rc_npz"] == 0, "ferrox vs HF on the same float32 weights must pass tight tolerances"


def test_save_only_writes_a_reference_without_comparing(saved):
    assert saved["rc_json"] == 0
    data = json.loads(saved["topk_json"].read_text())
    assert data["format"] == lr.REFERENCE_FORMAT and len(data["prompts"]) == 2
    first = data["prompts"][0]
    assert np.asarray(first["top_ids"]).shape == (len(first["token_ids"]), 5)
    assert len(first["greedy_ids"]) == 8


@pytest.mark.parametrize("ref", ["npz", "topk_json"])
def test_passes_against_saved_reference(saved, ref, capsys):
    rc = cl.main(["--model", saved["path"], "--reference-file", str(saved[ref]), "--json",
                  "--block-size", "8", "--max-chunk-tokens", "16", *TIGHT])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"], f"saved {ref} reference must pass: {report}"
    assert [p["greedy_match"] for p in report["prompts"]] == [8, 8]
    assert report["prompts"][0]["reference_kind"] == ("logits" if ref == "npz" else "top-5")


def test_npz_round_trip_keeps_every_field(saved):
    refs = lr.load_reference(saved["npz"])
    assert [r.text for r in refs] == ["The quick brown fox", "Hello world! How are you today?"]
    for r in refs:
        assert r.logits.shape[0] == len(r.token_ids) and len(r.greedy_ids) == 8


def test_fails_against_corrupted_logits(saved):
    refs = lr.load_reference(saved["npz"])
    refs[1].logits[3, 7] += 0.5  # one logit off by 0.5: far past 1e-4
    bad = saved["dir"] / "corrupt.npz"
    lr.save_reference(bad, refs)
    rc = cl.main(["--model", saved["path"], "--reference-file", str(bad), *GREEDY[2:], "--max-abs", "1e-4"])
    assert rc == 1, "a reference with one corrupted logit must fail --max-abs"


def test_fails_against_corrupted_top_k_and_greedy(saved):
    data = json.loads(saved["topk_json"].read_text())
    p = data["prompts"][0]
    p["top_ids"][0][0], p["top_ids"][0][1] = p["top_ids"][0][1], p["top_ids"][0][0]  # swap the top two ids
    p["greedy_ids"][4] = (p["greedy_ids"][4] + 1) % 300  # diverge at the fifth token
    bad = saved["dir"] / "corrupt.json"
    bad.write_text(json.dumps(data))
    common = ["--model", saved["path"], "--reference-file", str(bad), *GREEDY[2:]]
    assert cl.main([*common, "--min-top1", "1"]) == 1, "swapped top-1 ids must fail --min-top1"
    assert cl.main([*common, "--min-greedy-match", "8"]) == 1, "a greedy token changed at 5 must fail"
    assert cl.main([*common, "--min-greedy-match", "4"]) == 0, "the first 4 greedy tokens still match"


def test_fails_with_an_impossible_tolerance(saved):
    common = ["--model", saved["path"], "--reference-file", str(saved["npz"]), *GREEDY[2:]]
    assert cl.main([*common, "--max-kl", "-1"]) == 1, "KL is never negative"
    assert cl.main([*common, "--min-top1", "1.5"]) == 1, "agreement is a fraction, at most 1"
    assert cl.main([*common, "--min-greedy-match", "9"]) == 1, "the reference holds only 8 greedy tokens"


def test_malformed_reference_file_is_an_input_error(saved):
    bad = saved["dir"] / "malformed.json"
    bad.write_text(json.dumps({"format": lr.REFERENCE_FORMAT, "version": 1,
                               "prompts": [{"token_ids": [1, 2, 3], "logits": [[0.0, 1.0]]}]}))  # 1 row for 3 ids
    assert cl.main(["--model", saved["path"], "--reference-file", str(bad)]) == 2


def test_rejects_prompts_with_a_reference_file(saved):
    with pytest.raises(SystemExit) as e:
        cl.main(["--model", saved["path"], "--reference-file", str(saved["npz"]), "--prompt", "x"])
    assert e.value.code == 2


def test_top_k_kl_is_computed_over_the_renormalised_top_k():
    # Reference top-2 logprobs log(0.5), log(0.25) renormalise to (2/3, 1/3); ours puts
    # logits (0, 0, big negative) -> (1/2, 1/2) on those two ids after renormalising.
    ref = lr.PromptReference([5], top_ids=np.array([[0, 1]]), top_logprobs=np.log([[0.5, 0.25]]))
    ours = np.array([[0.0, 0.0, -30.0]])
    report = lr.compare_prompt(ref, ours, None)
    expected = 2 / 3 * np.log((2 / 3) / 0.5) + 1 / 3 * np.log((1 / 3) / 0.5)
    assert report.max_kl == pytest.approx(expected, rel=1e-9)
    assert report.top1 == 1.0


def test_quantized_mode_against_our_float32_reports_its_error(saved, capsys):
    """--reference float32 --quantization w8a8: the metrics are nonzero (it really compared a
    quantized model) and within the tiny model's error budget (tests/models/test_quant.py derives
    ~13 % of the logits' spread; this model's logits spread ~0.65, so max |Δ| < 0.1)."""
    rc = cl.main(["--model", saved["path"], "--reference", "float32", "--quantization", "w8a8", "--json",
                  *PROMPTS, *GREEDY, "--max-abs", "0.1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["quantization"] == "w8a8" and out["reference"] == "float32"
    assert all(0 < p["max_abs"] < 0.1 for p in out["prompts"])
    assert all(p["greedy_match"] is not None for p in out["prompts"])


def test_ours_file_measures_another_engine_like_ferrox(saved, capsys):
    """--ours-file: another engine's logits (tools/parity/llamacpp_logits.py writes llama.cpp's in this
    format) against the reference, without running ferrox: identical logits give KL 0 and all 8
    greedy tokens; a greedy token changed at 3 and one logit row moved give exactly that."""
    refs = lr.load_reference(saved["npz"])
    common = ["--reference-file", str(saved["npz"]), "--json"]
    same = saved["dir"] / "engine_same.npz"
    lr.save_reference(same, refs)
    assert cl.main([*common, "--ours-file", str(same), "--max-kl", "0", "--min-greedy-match", "8"]) == 0
    capsys.readouterr()
    refs[0].greedy_ids[3] = (refs[0].greedy_ids[3] + 1) % 300
    refs[0].logits[1] = refs[0].logits[1][::-1].copy()  # one position's distribution reversed
    other = saved["dir"] / "engine_other.npz"
    lr.save_reference(other, refs)
    rc = cl.main([*common, "--ours-file", str(other), "--min-greedy-match", "8"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["ours_file"] == str(other)
    first, second = out["prompts"]
    assert first["greedy_match"] == 3 and second["greedy_match"] == 8
    assert first["max_kl"] > 0.01 and second["max_kl"] == 0 and first["top1"] < 1


def test_ours_file_with_other_token_ids_is_an_input_error(saved):
    refs = lr.load_reference(saved["npz"])
    refs[1].token_ids[0] += 1
    bad = saved["dir"] / "engine_bad_ids.npz"
    lr.save_reference(bad, refs)
    assert cl.main(["--reference-file", str(saved["npz"]), "--ours-file", str(bad)]) == 2


def test_float32_reference_can_be_saved_alone(saved):
    out = saved["dir"] / "f32.npz"
    assert cl.main(["--model", saved["path"], "--reference", "float32", "--save-reference", str(out),
                    "--save-only", *PROMPTS, *GREEDY]) == 0
    refs = lr.load_reference(out)
    assert len(refs) == 2 and all(len(r.greedy_ids) == 8 and r.logits is not None for r in refs)
