"""Offline correctness check: ferrox_jax's logits and greedy tokens against a reference.

    python -m tools.parity.compare_logits --model default --reference hf --chat \\
        --prompt "What is 2+2?" --max-abs 1e-3 --min-greedy-match 32

Each prompt is tokenized with the checkpoint's own tokenizer (`--chat` first renders it
through the checkpoint's chat template as one user message) and run through ferrox_jax
twice: once through `ModelRunner.run_logits` for the logits at every prompt position,
and once through the real bucketed serving path (`ModelRunner.run`: chunked prefill,
then one-row decode steps, greedy) for a `--greedy-tokens` continuation. Both use a
shuffled block table, so a paging bug shows. The continuation ignores EOS on both sides.

References:
  --reference float32    ferrox_jax itself, unquantized in float32: the reference for a
                         quantized mode (`--quantization int8` or `w8a8`), so the metrics
                         measure what the quantization alone costs.
  --reference hf         HF transformers (a dev dependency, imported only here) loading the
                         same checkpoint in float32: an HF folder with `from_pretrained(dir)`,
                         a `.gguf` with `from_pretrained(parent_dir, gguf_file=name)`.
  --reference-file F     a file made anywhere (format below); its token ids are used as-is.
  --save-reference F     write the HF (or float32) reference to F (`.npz` or `.json`) so it can
                         be made on another machine; `--save-only` skips the comparison
                         (for hf: skips loading ferrox's model; our tokenizer still makes
                         the token ids).

Another engine measured the same way: `--ours-file F` takes "our" side from a file in the
reference format (its token ids must be the reference's) instead of running ferrox_jax;
tools/parity/llamacpp_logits.py writes llama.cpp's logits so (bench/quant/blocks/accuracy.sh).
`--save-ours F` (with --prompt / --prompts-file and no reference) writes ferrox_jax's own side
in that format: its logits at every prompt position and its greedy continuation, through the
same paths and kernels as a comparison; tools/parity/streamed_reference.py teacher-forces such
a file's continuation when the float32 model is too big to hold.

Reference files, their format and the metrics (max_abs, KL mean / max, top-1 agreement,
greedy match) are defined in models/reference.py, which tests share with this tool.

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

from ferrox_jax.step_output import run_plan
from models.reference import (PromptReference, PromptReport, compare_prompt, format_report, hf_reference,
                              load_hf_model, load_reference, save_reference, to_top_k, tolerance_failures)

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


# ---- ferrox_jax side ---------------------------------------------------------------------


class FerroxSide:
    """A ModelRunner sized for the prompts at hand, with shuffled block tables.

    Prompt logits of up to `num_tables` prompts come from one `run_logits` call (one
    compile per call shape); greedy continuations run one prompt at a time.
    """

    def __init__(self, model, max_total_tokens: int, num_tables: int = 1, block_size: int = 16,
                 max_chunk_tokens: int = 128, kv_dtype=None):
        from ferrox_jax.runner import ModelRunner

        needed = math.ceil(max_total_tokens / block_size)
        num_blocks = (num_tables + 1) * needed + 1  # one table's worth spare, so the shuffle spreads
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, max_rows=1,
                                  max_chunk_tokens=max_chunk_tokens, max_context=needed * block_size,
                                  kv_dtype=kv_dtype)
        # Block 0 is the null block; a fixed shuffle keeps runs reproducible.
        ids = np.random.RandomState(0).permutation(np.arange(1, num_blocks)).tolist()
        self.tables = [tuple(ids[i * needed:(i + 1) * needed]) for i in range(num_tables)]

    def prompt_logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """f32[n, V] per prompt: the logits after each prompt token (`run_logits`, unbucketed)."""
        from ferrox_jax.plan import RowPlan

        out = []
        for i in range(0, len(prompts), len(self.tables)):
            rows = [RowPlan(row_id=j, token_ids=tuple(ids), start_pos=0, block_ids=table, sample=False)
                    for j, (ids, table) in enumerate(zip(prompts[i:i + len(self.tables)], self.tables))]
            out.extend(self.runner.run_logits(rows))
        return out

    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation through the serving path: chunked prefill, then decode steps."""
        from ferrox_jax.plan import RowPlan, StepPlan
        from ferrox_jax.request import RowSampling

        if num_tokens <= 0:
            return []
        greedy = RowSampling(temperature=0.0)
        chunk = self.runner.max_chunk_tokens
        out: list[int] = []
        for pos in range(0, len(token_ids), chunk):
            ids = tuple(token_ids[pos:pos + chunk])
            last = pos + len(ids) == len(token_ids)
            row = RowPlan(row_id=1, token_ids=ids, start_pos=pos, block_ids=self.tables[0], sample=last,
                          sampling=greedy)
            res = run_plan(self.runner, StepPlan(chunks=(row,)))
        out.append(res.results[1].token_id)
        while len(out) < num_tokens:
            row = RowPlan(row_id=1, token_ids=(out[-1],), start_pos=len(token_ids) + len(out) - 1,
                          block_ids=self.tables[0], sample=True, sampling=greedy)
            out.append(run_plan(self.runner, StepPlan(decode=(row,))).results[1].token_id)
        return out


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
        prog="python -m tools.parity.compare_logits",
        description="Compare ferrox_jax's logits and greedy tokens with HF transformers or a reference file.",
        epilog="Reference file format and metric definitions: see docs/compare_logits.md.")
    p.add_argument("--model", default="default", help="HF folder, .gguf file, or 'default' (the embedded SmolLM2)")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", choices=["hf", "float32"],
                     help="hf: HF transformers in float32; float32: ferrox_jax itself, unquantized in float32 "
                          "(the reference for --quantization)")
    ref.add_argument("--reference-file", metavar="F", help="a .json or .npz reference file (its token ids are used)")
    p.add_argument("--save-reference", metavar="F", help="write the HF reference to F (.json or .npz)")
    p.add_argument("--save-top-k", type=int, default=0, metavar="K",
                   help="save only each position's top-K logprobs instead of full logits (0: full logits)")
    p.add_argument("--save-only", action="store_true", help="with --save-reference: save, do not run ferrox_jax")
    p.add_argument("--ours-file", metavar="F",
                   help="compare this file's logits and greedy tokens (reference format, e.g. llama.cpp's from "
                        "tools/parity/llamacpp_logits.py) instead of running ferrox_jax")
    p.add_argument("--save-ours", metavar="F",
                   help="without a reference: write ferrox_jax's logits and greedy continuation of the prompts "
                        "to F (reference format), e.g. for tools/parity/streamed_reference.py --along")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", metavar="F", help="prompts, one per line or a JSON list of strings")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="ferrox_jax compute dtype")
    p.add_argument("--quantization", choices=["none", "int8", "w8a8", "w8a8-block32", "gguf"], default="none",
                   help="ferrox_jax weight quantization (models/quant.py; gguf: models/gguf_blocks.py)")
    p.add_argument("--block-int-rows", type=int, default=None, metavar="N",
                   help="gguf on the block kernel: quantize activations to 32-wide int8 blocks from N rows on "
                        "(0: never; default: the serving threshold)")
    p.add_argument("--block-wide-rows", type=int, default=None, metavar="N",
                   help="gguf on the block kernel's AVX-512 VNNI build: 32-wide int16 activation blocks from N "
                        "rows on (0: never; default: the serving threshold)")
    p.add_argument("--cpu-kernels", choices=["auto", "off"], default="auto",
                   help="ferrox's x86 CPU kernels as the server runs them (models/cpu_kernels.py): the decode "
                        "attention, and the int8 matmul under w8a8; auto: where they can run")
    p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="ferrox_jax's KV cache (default: what `ferrox serve` picks for the mode: float16 "
                        "for gguf on a CPU, else the compute dtype); the float32 reference keeps float32")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--max-chunk-tokens", "--max-prefill-tokens", dest="max_chunk_tokens", type=int, default=128,
                   help="largest prompt chunk (default 128)")
    p.add_argument("--max-abs", type=float, help="fail when max |Δlogit| (top-k refs: |Δlogprob|) exceeds this")
    p.add_argument("--max-kl", type=float, help="fail when the max per-position KL(ref||ours) exceeds this")
    p.add_argument("--min-top1", type=float, help="fail when top-1 agreement (a fraction) is below this")
    p.add_argument("--min-greedy-match", type=int, help="fail when fewer leading greedy tokens match")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _cpu_kernels(args: argparse.Namespace):
    """models.cpu_kernels when --cpu-kernels auto and they can run here, else None."""
    import jax

    from models import cpu_kernels

    if args.cpu_kernels == "off" or cpu_kernels.runtime_problems(jax.default_backend()):
        return None
    return cpu_kernels


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.reference or args.reference_file or args.save_ours):
        p.error("one of --reference, --reference-file or --save-ours is required")
    if args.save_ours and (args.reference or args.reference_file or args.ours_file):
        p.error("--save-ours runs ferrox_jax on the prompts alone; drop --reference / --reference-file / --ours-file")
    if args.reference_file and (args.prompt or args.prompts_file or args.chat):
        p.error("--reference-file brings its own token ids; drop --prompt / --prompts-file / --chat")
    if args.save_reference and args.reference not in ("hf", "float32"):
        p.error("--save-reference needs --reference hf or float32")
    if args.ours_file and (args.save_only or args.quantization != "none"):
        p.error("--ours-file replaces ferrox_jax's side; drop --save-only / --quantization")
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


def _float32_references(args, tokenizer) -> list[PromptReference]:
    """Our own unquantized float32 model as the reference: prompt logits and greedy tokens."""
    import jax.numpy as jnp

    from models.loader import load_checkpoint

    texts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    texts = texts or list(DEFAULT_PROMPTS)
    encoded = [(t, encode_prompt(tokenizer, t, args.chat)) for t in texts]
    _log(f"loading the float32 reference from {args.model} ...")
    model = load_checkpoint(args.model, dtype=jnp.float32).model
    max_total = max(len(ids) for _, ids in encoded) + args.greedy_tokens
    side = FerroxSide(model, max_total, 1, args.block_size, args.max_chunk_tokens)
    logits = side.prompt_logits([ids for _, ids in encoded])
    refs = [PromptReference(token_ids=list(ids), text=t, logits=lg, greedy_ids=side.greedy(ids, args.greedy_tokens))
            for (t, ids), lg in zip(encoded, logits)]
    if args.save_reference:
        save_reference(args.save_reference, refs)
        _log(f"wrote {len(refs)} prompts to {args.save_reference}")
    return refs


def ours_references(args, ckpt, kv_dtype) -> list[PromptReference]:
    """ferrox_jax's own side of the prompts, as a reference file holds it (--save-ours)."""
    texts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    encoded = [(t, encode_prompt(ckpt.tokenizer, t, args.chat)) for t in texts or DEFAULT_PROMPTS]
    max_total = max(len(ids) for _, ids in encoded) + args.greedy_tokens
    side = FerroxSide(ckpt.model, max_total, 1, args.block_size, args.max_chunk_tokens, kv_dtype)
    logits = side.prompt_logits([ids for _, ids in encoded])
    return [PromptReference(token_ids=list(ids), text=t, logits=lg, greedy_ids=side.greedy(ids, args.greedy_tokens))
            for (t, ids), lg in zip(encoded, logits)]


def file_comparison(refs: list[PromptReference], ours_path: str) -> list[PromptReport]:
    """Compare another engine's logits and greedy tokens (a reference-format file) with refs."""
    ours = load_reference(ours_path)
    if len(ours) != len(refs):
        raise ValueError(f"{ours_path} has {len(ours)} prompts, the reference {len(refs)}")
    for i, (r, o) in enumerate(zip(refs, ours)):
        if list(o.token_ids) != list(r.token_ids):
            raise ValueError(f"prompt {i}: {ours_path}'s token ids differ from the reference's")
        if o.logits is None:
            raise ValueError(f"prompt {i}: {ours_path} needs full logits, not top-k")
    return [compare_prompt(r, o.logits, o.greedy_ids) for r, o in zip(refs, ours)]


LOGITS_CALL_BYTES = 1 << 30  # cap on one run_logits call's f32[rows, T, V] output


def run_comparison(model, refs: list[PromptReference], block_size: int = 16,
                   max_chunk_tokens: int = 128, kv_dtype=None) -> list[PromptReport]:
    """Run every reference prompt through ferrox_jax (`model`: a LlamaModel; its KV cache in
    `kv_dtype`, default the model's) and compare."""
    vocab_size = model.cfg.vocab_size
    for i, r in enumerate(refs):
        bad = [t for t in [*r.token_ids, *(r.greedy_ids or ())] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
    max_prompt = max(len(r.token_ids) for r in refs)
    max_total = max(len(r.token_ids) + len(r.greedy_ids or ()) for r in refs)
    per_call = max(1, min(len(refs), 8, LOGITS_CALL_BYTES // (4 * max_prompt * vocab_size)))
    side = FerroxSide(model, max_total, per_call, block_size, max_chunk_tokens, kv_dtype)
    logits = side.prompt_logits([r.token_ids for r in refs])
    reports = []
    for r, ours in zip(refs, logits):
        greedy = side.greedy(r.token_ids, len(r.greedy_ids)) if r.greedy_ids is not None else None
        reports.append(compare_prompt(r, ours, greedy))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    t0 = time.perf_counter()
    run_ours = not (args.save_only or args.ours_file)
    kernels = _cpu_kernels(args) if run_ours else None
    try:
        ckpt = None
        if run_ours:
            import jax.numpy as jnp

            from models import cpu_attention
            from models.loader import load_checkpoint

            _log(f"loading {args.model} into ferrox_jax ({args.dtype}, quantization {args.quantization}) ...")
            ckpt = load_checkpoint(args.model, dtype=jnp.dtype(args.dtype), quantization=args.quantization,
                                   decode_attention=cpu_attention.decode_attention() if kernels else None)
            if kernels and args.quantization == "w8a8":
                kernels.pack_for_kernel(ckpt.model)
            if kernels and args.quantization == "gguf":
                kernels.pack_blocks_for_kernel(ckpt.model, args.block_int_rows, wide_rows=args.block_wide_rows)
        if args.save_ours:
            from ferrox_jax.quant_setup import resolve_kv_dtype

            kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, args.quantization, jnp.dtype(args.dtype))
            save_reference(args.save_ours, ours_references(args, ckpt, kv_dtype))
            _log(f"wrote ferrox_jax's side to {args.save_ours} ({time.perf_counter() - t0:.1f} s)")
            return 0
        if args.reference == "hf":
            refs = _hf_references(args, ckpt.tokenizer if ckpt else load_tokenizer(args.model))
        elif args.reference == "float32":
            refs = _float32_references(args, ckpt.tokenizer if ckpt else load_tokenizer(args.model))
        else:
            refs = load_reference(args.reference_file)
        if args.save_only:
            return 0
        if args.ours_file:
            reports = file_comparison(refs, args.ours_file)
        else:
            from ferrox_jax.quant_setup import resolve_kv_dtype

            kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, args.quantization, jnp.dtype(args.dtype))
            args.kv_cache_dtype = jnp.dtype(kv_dtype).name
            reports = run_comparison(ckpt.model, refs, args.block_size, args.max_chunk_tokens, kv_dtype)
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
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "ours_file": args.ours_file,
            "cpu_kernels": kernels is not None,
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
