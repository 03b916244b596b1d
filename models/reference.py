"""Reference logits and how a model's logits are judged against them.

What `tools/parity/compare_logits.py`, llama.cpp's side (`tools/parity/llamacpp_logits.py`)
and the tests share: a reference's shape and file format, HF transformers as a reference,
and the metrics (log-softmax, KL, top-1, greedy match) with their tolerances. It imports
numpy only; torch, transformers and our loader are imported inside the functions that need
them, so tests and tools that only score logits stay light.

A `PromptReference` is a prompt's token ids with either the reference's raw logits at
every position or its top-k log-probabilities, and optionally its greedy continuation.
References come from HF transformers (`hf_reference`, float32 on the CPU; a dev
dependency, imported only when asked for) or from a file made anywhere.

Reference file format (version 1). Per prompt: `token_ids` (the prompt, int[n]); then
either `logits` (raw logits, float[n, V]: row i scores the token after token_ids[i]) or
`top_ids` + `top_logprobs` (int[n, k] and float[n, k]: the reference's k most likely
next tokens at each position with their log-probabilities over the full vocabulary);
optionally `greedy_ids` (int[g]: the greedy continuation after the prompt) and `text`.
A teacher-forced reference (`tools/parity/streamed_reference.py`) also has `along_ids`
(int[g]: a continuation another engine chose); its `greedy_ids[i]` is then the
reference's argmax after the prompt + along_ids[:i], which is the reference's own greedy
continuation up to and including the first i where the two differ (`greedy_known_prefix`).

  .json  {"format": "ferrox-logits-reference", "version": 1,
          "prompts": [{"text": "...", "token_ids": [...], "logits": [[...], ...],
                       "greedy_ids": [...]}, ...]}
  .npz   scalar "format" ("ferrox-logits-reference/1") and "num_prompts"; per prompt i the
         arrays "p{i}.token_ids", "p{i}.logits" or "p{i}.top_ids" + "p{i}.top_logprobs",
         optionally "p{i}.greedy_ids", "p{i}.along_ids" and "p{i}.text" (a 0-d string
         array; no pickles).

Metrics per prompt, over its n positions (`compare_prompt`):
  max_abs     full logits: max |ours - ref| over every logit. Top-k references: max
              |Δ logprob| over the reference's top-k ids (logits have an arbitrary offset,
              log-probabilities do not).
  KL          KL(ref || ours) per position, in nats; reported as mean and max. Top-k
              references: both distributions are restricted to the reference's top-k ids
              and renormalised there, so it is the KL of the two next-token distributions
              given that the token is one of the reference's top k. It neither bounds nor
              estimates the full-vocabulary KL, which needs full logits.
  top1        fraction of positions where our argmax over the vocabulary is the
              reference's most likely token.
  greedy      number of leading tokens of our greedy continuation equal to the
              reference's, out of the reference's length. With `along_ids`, against the
              part of the reference's continuation that is known (`greedy_known_prefix`):
              exact when ours is the continuation the reference was forced along (then
              they part where the reference's argmax leaves it), else exact up to where
              ours leaves it and a lower bound past that.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

REFERENCE_FORMAT = "ferrox-logits-reference"
REFERENCE_VERSION = 1


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 (logits of any float dtype in)."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logp: np.ndarray, ours_logp: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row, in nats; both are log-probabilities over the same support.
    Tokens the reference gives probability 0 (logit -inf) contribute 0, not NaN."""
    p = np.exp(ref_logp)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (ref_logp - ours_logp), 0.0).sum(axis=-1)


@dataclasses.dataclass
class PromptReference:
    """What a reference says about one prompt (shapes in the module docstring)."""

    token_ids: list[int]
    text: str | None = None
    logits: np.ndarray | None = None  # f32[n, V]
    top_ids: np.ndarray | None = None  # i32[n, k]
    top_logprobs: np.ndarray | None = None  # f32[n, k]
    greedy_ids: list[int] | None = None  # the continuation after token_ids
    along_ids: list[int] | None = None  # teacher-forced continuation greedy_ids was taken along

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("reference prompt has no tokens")
        if (self.logits is None) == (self.top_ids is None):
            raise ValueError("a reference prompt needs exactly one of logits or top_ids + top_logprobs")
        if self.logits is not None and (self.logits.ndim != 2 or self.logits.shape[0] != n):
            raise ValueError(f"logits must be [n, V] with n = {n} token ids; got shape {self.logits.shape}")
        if self.top_ids is not None:
            if self.top_logprobs is None or self.top_ids.shape != self.top_logprobs.shape:
                raise ValueError("top_ids and top_logprobs must both be given with the same shape; got "
                                 f"{self.top_ids.shape} and {getattr(self.top_logprobs, 'shape', None)}")
            if self.top_ids.ndim != 2 or self.top_ids.shape[0] != n:
                raise ValueError(f"top_ids must be [n, k] with n = {n} token ids; got shape {self.top_ids.shape}")
        if self.along_ids is not None and len(self.along_ids) != len(self.greedy_ids or ()):
            raise ValueError(f"along_ids has {len(self.along_ids)} tokens, greedy_ids {len(self.greedy_ids or ())}; "
                             "a teacher-forced reference has one argmax per continuation step")

    @property
    def kind(self) -> str:
        return "logits" if self.logits is not None else f"top-{self.top_ids.shape[1]}"


# ---- HF transformers reference -----------------------------------------------------------


def load_hf_model(path: str):
    """The HF transformers model for the same checkpoint, float32, eval mode."""
    import torch
    import transformers

    from models.loader import resolve_path

    p = resolve_path(path)
    if p.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    return model.eval()


def hf_cache_kwarg(hf_model) -> str:
    """The KV cache argument's name: `cache` in recent transformers 5.x, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def hf_reference(hf_model, token_ids: list[int], greedy_tokens: int, text: str | None = None,
                 top_k: int = 0) -> PromptReference:
    """Prompt logits (or their top-k logprobs) and a greedy continuation (HF's KV cache)."""
    import torch

    cache_kwarg = hf_cache_kwarg(hf_model)
    with torch.no_grad():
        out = hf_model(torch.tensor([token_ids]), use_cache=True)
        logits = out.logits[0].float().numpy()
        greedy = [int(logits[-1].argmax())] if greedy_tokens else []
        while len(greedy) < greedy_tokens:
            cache = getattr(out, "cache", None)
            cache = out.past_key_values if cache is None else cache
            out = hf_model(torch.tensor([[greedy[-1]]]), use_cache=True, **{cache_kwarg: cache})
            greedy.append(int(out.logits[0, -1].argmax()))
    ref = PromptReference(list(token_ids), text, logits=logits, greedy_ids=greedy)
    return to_top_k(ref, top_k) if top_k else ref


def to_top_k(ref: PromptReference, k: int) -> PromptReference:
    """The same reference with each position's top-k logprobs in place of full logits."""
    logp = log_softmax(ref.logits)
    ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    return PromptReference(ref.token_ids, ref.text, top_ids=ids.astype(np.int32),
                           top_logprobs=np.take_along_axis(logp, ids, axis=-1).astype(np.float32),
                           greedy_ids=ref.greedy_ids, along_ids=ref.along_ids)


# ---- reference files ---------------------------------------------------------------------


def save_reference(path: str | Path, refs: list[PromptReference]) -> None:
    path = Path(path)
    if path.suffix == ".json":
        prompts = []
        for r in refs:
            d: dict = {"text": r.text, "token_ids": list(map(int, r.token_ids))}
            if r.logits is not None:
                d["logits"] = r.logits.astype(np.float32).tolist()
            else:
                d["top_ids"] = r.top_ids.tolist()
                d["top_logprobs"] = r.top_logprobs.astype(np.float32).tolist()
            if r.greedy_ids is not None:
                d["greedy_ids"] = list(map(int, r.greedy_ids))
            if r.along_ids is not None:
                d["along_ids"] = list(map(int, r.along_ids))
            prompts.append(d)
        path.write_text(json.dumps({"format": REFERENCE_FORMAT, "version": REFERENCE_VERSION, "prompts": prompts}))
    elif path.suffix == ".npz":
        arrays = {"format": np.array(f"{REFERENCE_FORMAT}/{REFERENCE_VERSION}"), "num_prompts": np.array(len(refs))}
        for i, r in enumerate(refs):
            arrays[f"p{i}.token_ids"] = np.asarray(r.token_ids, np.int32)
            if r.logits is not None:
                arrays[f"p{i}.logits"] = r.logits.astype(np.float32)
            else:
                arrays[f"p{i}.top_ids"] = r.top_ids.astype(np.int32)
                arrays[f"p{i}.top_logprobs"] = r.top_logprobs.astype(np.float32)
            if r.greedy_ids is not None:
                arrays[f"p{i}.greedy_ids"] = np.asarray(r.greedy_ids, np.int32)
            if r.along_ids is not None:
                arrays[f"p{i}.along_ids"] = np.asarray(r.along_ids, np.int32)
            if r.text is not None:
                arrays[f"p{i}.text"] = np.array(r.text)
        with path.open("wb") as f:
            np.savez_compressed(f, **arrays)
    else:
        raise ValueError(f"reference file must end in .json or .npz; got {path.name}")


def _opt_array(value, dtype):
    return None if value is None else np.asarray(value, dtype)


def load_reference(path: str | Path) -> list[PromptReference]:
    """Read a reference file (format in the module docstring). Raises ValueError when malformed."""
    path = Path(path)
    try:
        entries = _reference_entries(path)
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e}") from e
    refs = []
    for i, e in enumerate(entries):
        try:
            refs.append(PromptReference(
                token_ids=[int(t) for t in np.asarray(e["token_ids"]).reshape(-1)], text=e.get("text"),
                logits=_opt_array(e.get("logits"), np.float32), top_ids=_opt_array(e.get("top_ids"), np.int64),
                top_logprobs=_opt_array(e.get("top_logprobs"), np.float32),
                greedy_ids=None if e.get("greedy_ids") is None else [int(t) for t in e["greedy_ids"]],
                along_ids=None if e.get("along_ids") is None else [int(t) for t in e["along_ids"]],
            ))
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{path}: prompt {i}: {err}") from err
    if not refs:
        raise ValueError(f"{path}: no prompts")
    return refs


def _reference_entries(path: Path) -> list[dict]:
    """The per-prompt field dicts of a .json or .npz reference file, format checked."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object with format, version and prompts")
        if data.get("format") != REFERENCE_FORMAT or data.get("version") != REFERENCE_VERSION:
            raise ValueError(f"{path}: expected format {REFERENCE_FORMAT!r} version {REFERENCE_VERSION}; "
                             f"got {data.get('format')!r} version {data.get('version')!r}")
        entries = data["prompts"]
    elif path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            fmt = str(z["format"]) if "format" in z else None
            if fmt != f"{REFERENCE_FORMAT}/{REFERENCE_VERSION}":
                raise ValueError(f"{path}: expected format {REFERENCE_FORMAT}/{REFERENCE_VERSION}; got {fmt!r}")
            entries = []
            for i in range(int(z["num_prompts"])):
                e = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(f"p{i}.")}
                if "text" in e:
                    e["text"] = str(e["text"])
                entries.append(e)
    else:
        raise ValueError(f"reference file must end in .json or .npz; got {path.name}")
    return entries


# ---- metrics -----------------------------------------------------------------------------


@dataclasses.dataclass
class PromptReport:
    """The comparison of one prompt (metrics defined in the module docstring)."""

    text: str | None
    num_tokens: int
    reference_kind: str  # "logits" or "top-k"
    max_abs: float
    mean_kl: float
    max_kl: float
    top1: float
    greedy_match: int | None  # None when the reference has no greedy continuation
    greedy_tokens: int


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_known_prefix(ref: PromptReference) -> list[int]:
    """The part of the reference's greedy continuation that is its own: all of greedy_ids,
    or, teacher-forced along `along_ids`, up to and including the first step they differ."""
    greedy = list(ref.greedy_ids or ())
    if ref.along_ids is None:
        return greedy
    return greedy[:common_prefix_len(greedy, ref.along_ids) + 1]


def compare_prompt(ref: PromptReference, ours_logits: np.ndarray, ours_greedy: list[int] | None) -> PromptReport:
    """Metrics of our logits f32[n, V] (and greedy tokens) against one reference prompt."""
    n = len(ref.token_ids)
    if ours_logits.shape[0] != n:
        raise ValueError(f"ours has logits for {ours_logits.shape[0]} positions, the reference for {n}")
    ours_logp = log_softmax(ours_logits)
    if ref.logits is not None:
        if ref.logits.shape != ours_logits.shape:
            raise ValueError(f"reference logits {ref.logits.shape} and ours {ours_logits.shape} differ in shape")
        max_abs = float(np.abs(ours_logits.astype(np.float64) - ref.logits).max())
        kl = kl_divergence(log_softmax(ref.logits), ours_logp)
        ref_top1 = ref.logits.argmax(axis=-1)
    else:
        ids = ref.top_ids.astype(np.int64)
        if ids.max() >= ours_logits.shape[1] or ids.min() < 0:
            raise ValueError(f"reference top_ids reach {ids.max()}, outside our vocabulary of {ours_logits.shape[1]}")
        ref_lp = ref.top_logprobs.astype(np.float64)
        ours_lp = np.take_along_axis(ours_logp, ids, axis=-1)
        max_abs = float(np.abs(ours_lp - ref_lp).max())
        kl = kl_divergence(log_softmax(ref_lp), log_softmax(ours_lp))  # both renormalised over the top k
        ref_top1 = np.take_along_axis(ids, ref_lp.argmax(axis=-1)[:, None], axis=-1)[:, 0]
    greedy_match = None
    if ref.greedy_ids is not None and ours_greedy is not None:
        greedy_match = common_prefix_len(ours_greedy, greedy_known_prefix(ref))
    return PromptReport(
        text=ref.text, num_tokens=n, reference_kind=ref.kind, max_abs=max_abs,
        mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        top1=float((ours_logits.argmax(axis=-1) == ref_top1).mean()),
        greedy_match=greedy_match, greedy_tokens=len(ref.greedy_ids or ()),
    )


def tolerance_failures(report: PromptReport, max_abs=None, max_kl=None, min_top1=None,
                       min_greedy_match=None) -> list[str]:
    """Why one prompt misses the given tolerances (None = not checked). NaN always fails."""
    out = []
    if max_abs is not None and not report.max_abs <= max_abs:
        out.append(f"max |Δ| {report.max_abs:.3g} > {max_abs:g}")
    if max_kl is not None and not report.max_kl <= max_kl:
        out.append(f"max KL {report.max_kl:.3g} > {max_kl:g}")
    if min_top1 is not None and not report.top1 >= min_top1:
        out.append(f"top-1 agreement {report.top1:.3f} < {min_top1:g}")
    if min_greedy_match is not None:
        if report.greedy_match is None:
            out.append("greedy match asked for but the reference has no greedy continuation")
        elif report.greedy_match < min_greedy_match:
            out.append(f"greedy match {report.greedy_match}/{report.greedy_tokens} < {min_greedy_match}")
    return out


def format_report(i: int, r: PromptReport, failures: list[str]) -> str:
    """One line per prompt: its metrics and whether it met the tolerances."""
    greedy = "-" if r.greedy_match is None else f"{r.greedy_match}/{r.greedy_tokens}"
    text = "" if r.text is None else f"  {r.text[:40]!r}"
    status = "ok" if not failures else "FAIL: " + "; ".join(failures)
    return (f"prompt {i} ({r.num_tokens} tokens, {r.reference_kind}): max|Δ| {r.max_abs:.3g}  "
            f"KL mean {r.mean_kl:.3g} max {r.max_kl:.3g}  top-1 {r.top1:.3f}  greedy {greedy}  {status}{text}")
