"""Offline correctness check: ferrox_jax's logits and greedy tokens against a reference.

    python -m tools.compare_logits --model default --reference hf --chat \\
        --prompt "What is 2+2?" --max-abs 1e-3 --min-greedy-match 32

Each prompt is tokenized with the checkpoint's own tokenizer (`--chat` first renders it
through the checkpoint's chat template as one user message) and run through ferrox_jax
twice: once through `ModelRunner.run_logits` for the logits at every prompt position,
and once through the real bucketed serving path (`ModelRunner.run`: chunked prefill,
then one-row decode steps, greedy) for a `--greedy-tokens` continuation. Both use a
shuffled block table, so a paging bug shows. The continuation ignores EOS on both sides.

References:
  --reference hf         HF transformers (a dev dependency, imported only here) loading the
                         same checkpoint in float32: an HF folder with `from_pretrained(dir)`,
                         a `.gguf` with `from_pretrained(parent_dir, gguf_file=name)`.
  --reference-file F     a file made anywhere (format below); its token ids are used as-is.
  --save-reference F     write the HF reference to F (`.npz` or `.json`) so it can be made on
                         another machine; `--save-only` skips loading ferrox's model
                         (our tokenizer still makes the token ids).

Reference file format (version 1). Per prompt: `token_ids` (the prompt, int[n]); then
either `logits` (raw logits, float[n, V]: row i scores the token after token_ids[i]) or
`top_ids` + `top_logprobs` (int[n, k] and float[n, k]: the reference's k most likely
next tokens at each position with their log-probabilities over the full vocabulary);
optionally `greedy_ids` (int[g]: the greedy continuation after the prompt) and `text`.

  .json  {"format": "ferrox-logits-reference", "version": 1,
          "prompts": [{"text": "...", "token_ids": [...], "logits": [[...], ...],
                       "greedy_ids": [...]}, ...]}
  .npz   scalar "format" ("ferrox-logits-reference/1") and "num_prompts"; per prompt i the
         arrays "p{i}.token_ids", "p{i}.logits" or "p{i}.top_ids" + "p{i}.top_logprobs",
         optionally "p{i}.greedy_ids" and "p{i}.text" (a 0-d string array; no pickles).

Metrics per prompt, over its n positions:
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
              reference's, out of the reference's length (default `--greedy-tokens` 32).

Exit status: 0 when every tolerance given (--max-abs, --max-kl on the max KL, --min-top1,
--min-greedy-match) holds for every prompt, 1 when one does not (or a metric a tolerance
needs is missing from the reference, or is NaN), 2 on a usage or input error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REFERENCE_FORMAT = "ferrox-logits-reference"
REFERENCE_VERSION = 1
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


@dataclasses.dataclass
class PromptReference:
    """What a reference says about one prompt (shapes in the module docstring)."""

    token_ids: list[int]
    text: str | None = None
    logits: np.ndarray | None = None  # f32[n, V]
    top_ids: np.ndarray | None = None  # i32[n, k]
    top_logprobs: np.ndarray | None = None  # f32[n, k]
    greedy_ids: list[int] | None = None  # the continuation after token_ids

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

    @property
    def kind(self) -> str:
        return "logits" if self.logits is not None else f"top-{self.top_ids.shape[1]}"


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


# ---- metrics -----------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _kl(ref_logp: np.ndarray, ours_logp: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row; both are log-probabilities over the same support.
    Tokens the reference gives probability 0 (logit -inf) contribute 0, not NaN."""
    p = np.exp(ref_logp)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (ref_logp - ours_logp), 0.0).sum(axis=-1)


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        kl = _kl(log_softmax(ref.logits), ours_logp)
        ref_top1 = ref.logits.argmax(axis=-1)
    else:
        ids = ref.top_ids.astype(np.int64)
        if ids.max() >= ours_logits.shape[1] or ids.min() < 0:
            raise ValueError(f"reference top_ids reach {ids.max()}, outside our vocabulary of {ours_logits.shape[1]}")
        ref_lp = ref.top_logprobs.astype(np.float64)
        ours_lp = np.take_along_axis(ours_logp, ids, axis=-1)
        max_abs = float(np.abs(ours_lp - ref_lp).max())
        kl = _kl(log_softmax(ref_lp), log_softmax(ours_lp))  # both renormalised over the top k
        ref_top1 = np.take_along_axis(ids, ref_lp.argmax(axis=-1)[:, None], axis=-1)[:, 0]
    greedy_match = None
    if ref.greedy_ids is not None and ours_greedy is not None:
        greedy_match = common_prefix_len(ours_greedy, ref.greedy_ids)
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


# ---- ferrox_jax side ---------------------------------------------------------------------


class FerroxSide:
    """A ModelRunner sized for the prompts at hand, with shuffled block tables.

    Prompt logits of up to `num_tables` prompts come from one `run_logits` call (one
    compile per call shape); greedy continuations run one prompt at a time.
    """

    def __init__(self, model, max_total_tokens: int, num_tables: int = 1, block_size: int = 16,
                 max_prefill_tokens: int = 128):
        from ferrox_jax.runner import ModelRunner

        needed = math.ceil(max_total_tokens / block_size)
        num_blocks = (num_tables + 1) * needed + 1  # one table's worth spare, so the shuffle spreads
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, max_rows=1,
                                  max_prefill_tokens=max_prefill_tokens, max_context=needed * block_size)
        # Block 0 is the null block; a fixed shuffle keeps runs reproducible.
        ids = np.random.RandomState(0).permutation(np.arange(1, num_blocks)).tolist()
        self.tables = [tuple(ids[i * needed:(i + 1) * needed]) for i in range(num_tables)]

    def prompt_logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """f32[n, V] per prompt: the logits after each prompt token (`run_logits`, unbucketed)."""
        from ferrox_jax.plan import RowStep

        out = []
        for i in range(0, len(prompts), len(self.tables)):
            rows = [RowStep(row_id=j, token_ids=tuple(ids), start_pos=0, block_ids=table, sample=False)
                    for j, (ids, table) in enumerate(zip(prompts[i:i + len(self.tables)], self.tables))]
            out.extend(self.runner.run_logits(rows))
        return out

    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation through the serving path: chunked prefill, then decode steps."""
        from ferrox_jax.plan import RowStep, StepPlan
        from ferrox_jax.request import SamplingParams

        if num_tokens <= 0:
            return []
        greedy = SamplingParams(temperature=0.0)
        chunk = self.runner.max_prefill_tokens
        out: list[int] = []
        for pos in range(0, len(token_ids), chunk):
            ids = tuple(token_ids[pos:pos + chunk])
            last = pos + len(ids) == len(token_ids)
            row = RowStep(row_id=1, token_ids=ids, start_pos=pos, block_ids=self.tables[0], sample=last,
                          sampling=greedy)
            res = self.runner.run(StepPlan(prefill=(row,)))
        out.append(res.results[1].token_id)
        while len(out) < num_tokens:
            row = RowStep(row_id=1, token_ids=(out[-1],), start_pos=len(token_ids) + len(out) - 1,
                          block_ids=self.tables[0], sample=True, sampling=greedy)
            out.append(self.runner.run(StepPlan(decode=(row,))).results[1].token_id)
        return out


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


def _hf_cache_kwarg(hf_model) -> str:
    """The KV cache argument's name: `cache` in recent transformers 5.x, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def hf_reference(hf_model, token_ids: list[int], greedy_tokens: int, text: str | None = None,
                 top_k: int = 0) -> PromptReference:
    """Prompt logits (or their top-k logprobs) and a greedy continuation (HF's KV cache)."""
    import torch

    cache_kwarg = _hf_cache_kwarg(hf_model)
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
                           greedy_ids=ref.greedy_ids)


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


# ---- prompts -----------------------------------------------------------------------------


def read_prompts_file(path: str | Path) -> list[str]:
    """A JSON list of strings, or one prompt per non-empty line."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [line for line in text.splitlines() if line.strip()]
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        raise ValueError(f"{path}: a JSON prompts file must be a list of strings")
    return data


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt; with `chat`, of the chat template around one user message.

    A rendered template already spells its special tokens, so it is encoded without
    adding more (as transformers' apply_chat_template(tokenize=True) does).
    """
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens")
    return ids


def load_tokenizer(path: str):
    """The checkpoint's tokenizer alone (for --save-only, which does not load our model)."""
    from models.loader import resolve_path
    from models.tokenizer import Tokenizer

    p = resolve_path(path)
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    from models.loaders.gguf import open_gguf

    return Tokenizer.from_gguf(open_gguf(p))


# ---- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.compare_logits",
        description="Compare ferrox_jax's logits and greedy tokens with HF transformers or a reference file.",
        epilog="Reference file format and metric definitions: see docs/compare_logits.md.")
    p.add_argument("--model", default="default", help="HF folder, .gguf file, or 'default' (the embedded SmolLM2)")
    ref = p.add_mutually_exclusive_group(required=True)
    ref.add_argument("--reference", choices=["hf"], help="compute the reference with HF transformers (float32)")
    ref.add_argument("--reference-file", metavar="F", help="a .json or .npz reference file (its token ids are used)")
    p.add_argument("--save-reference", metavar="F", help="write the HF reference to F (.json or .npz)")
    p.add_argument("--save-top-k", type=int, default=0, metavar="K",
                   help="save only each position's top-K logprobs instead of full logits (0: full logits)")
    p.add_argument("--save-only", action="store_true", help="with --save-reference: save, do not run ferrox_jax")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", metavar="F", help="prompts, one per line or a JSON list of strings")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="ferrox_jax compute dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--max-prefill-tokens", type=int, default=128, help="largest prefill chunk (default 128)")
    p.add_argument("--max-abs", type=float, help="fail when max |Δlogit| (top-k refs: |Δlogprob|) exceeds this")
    p.add_argument("--max-kl", type=float, help="fail when the max per-position KL(ref||ours) exceeds this")
    p.add_argument("--min-top1", type=float, help="fail when top-1 agreement (a fraction) is below this")
    p.add_argument("--min-greedy-match", type=int, help="fail when fewer leading greedy tokens match")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.reference_file and (args.prompt or args.prompts_file or args.chat):
        p.error("--reference-file brings its own token ids; drop --prompt / --prompts-file / --chat")
    if args.save_reference and args.reference != "hf":
        p.error("--save-reference needs --reference hf")
    if args.save_only and not args.save_reference:
        p.error("--save-only needs --save-reference")
    if args.save_top_k < 0 or args.greedy_tokens < 0:
        p.error("--save-top-k and --greedy-tokens must be >= 0")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _hf_references(args, tokenizer) -> list[PromptReference]:
    texts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    texts = texts or list(DEFAULT_PROMPTS)
    encoded = [(t, encode_prompt(tokenizer, t, args.chat)) for t in texts]
    _log(f"loading HF transformers reference from {args.model} ...")
    hf_model = load_hf_model(args.model)
    refs = [hf_reference(hf_model, ids, args.greedy_tokens, text=t) for t, ids in encoded]
    if args.save_reference:
        # This run still compares against the full logits; only the file is trimmed.
        save_reference(args.save_reference, [to_top_k(r, args.save_top_k) for r in refs] if args.save_top_k else refs)
        _log(f"wrote {len(refs)} prompts to {args.save_reference}")
    return refs


LOGITS_CALL_BYTES = 1 << 30  # cap on one run_logits call's f32[rows, T, V] output


def run_comparison(model, refs: list[PromptReference], block_size: int = 16,
                   max_prefill_tokens: int = 128) -> list[PromptReport]:
    """Run every reference prompt through ferrox_jax (`model`: a LlamaModel) and compare."""
    vocab_size = model.cfg.vocab_size
    for i, r in enumerate(refs):
        bad = [t for t in [*r.token_ids, *(r.greedy_ids or ())] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
    max_prompt = max(len(r.token_ids) for r in refs)
    max_total = max(len(r.token_ids) + len(r.greedy_ids or ()) for r in refs)
    per_call = max(1, min(len(refs), 8, LOGITS_CALL_BYTES // (4 * max_prompt * vocab_size)))
    side = FerroxSide(model, max_total, per_call, block_size, max_prefill_tokens)
    logits = side.prompt_logits([r.token_ids for r in refs])
    reports = []
    for r, ours in zip(refs, logits):
        greedy = side.greedy(r.token_ids, len(r.greedy_ids)) if r.greedy_ids is not None else None
        reports.append(compare_prompt(r, ours, greedy))
    return reports


def format_report(i: int, r: PromptReport, failures: list[str]) -> str:
    greedy = "-" if r.greedy_match is None else f"{r.greedy_match}/{r.greedy_tokens}"
    text = "" if r.text is None else f"  {r.text[:40]!r}"
    status = "ok" if not failures else "FAIL: " + "; ".join(failures)
    return (f"prompt {i} ({r.num_tokens} tokens, {r.reference_kind}): max|Δ| {r.max_abs:.3g}  "
            f"KL mean {r.mean_kl:.3g} max {r.max_kl:.3g}  top-1 {r.top1:.3f}  greedy {greedy}  {status}{text}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    t0 = time.perf_counter()
    try:
        ckpt = None
        if not args.save_only:
            import jax.numpy as jnp

            from models.loader import load_checkpoint

            _log(f"loading {args.model} into ferrox_jax ({args.dtype}) ...")
            ckpt = load_checkpoint(args.model, dtype=jnp.dtype(args.dtype))
        if args.reference == "hf":
            refs = _hf_references(args, ckpt.tokenizer if ckpt else load_tokenizer(args.model))
        else:
            refs = load_reference(args.reference_file)
        if args.save_only:
            return 0
        reports = run_comparison(ckpt.model, refs, args.block_size, args.max_prefill_tokens)
    except (ValueError, FileNotFoundError) as e:
        _log(f"error: {e}")
        return 2
    tolerances = dict(max_abs=args.max_abs, max_kl=args.max_kl, min_top1=args.min_top1,
                      min_greedy_match=args.min_greedy_match)
    failures = [tolerance_failures(r, **tolerances) for r in reports]
    passed = not any(failures)
    if args.json:
        print(json.dumps({
            "model": args.model, "reference": args.reference or args.reference_file, "dtype": args.dtype,
            "tolerances": tolerances, "passed": passed, "elapsed_s": round(time.perf_counter() - t0, 3),
            "prompts": [{**dataclasses.asdict(r), "failures": f} for r, f in zip(reports, failures)],
        }, indent=2))
    else:
        for i, (r, f) in enumerate(zip(reports, failures)):
            print(format_report(i, r, f))
        print(f"{'PASS' if passed else 'FAIL'}: {len(reports)} prompts, {time.perf_counter() - t0:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
