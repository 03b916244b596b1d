"""Random-weight GGUFs of real model shapes, quantized by llama.cpp's own quantizer: the
reproducible anchor for CPU figures at the sizes people run, against llama-server.

    python -m tools.bench.shape_gguf llama-3.2-1b --quantizer /work/peer/build/bin/llama-quantize \\
        --types Q4_K_M Q4_0 --out-dir /work/gguf
    python -m tools.bench.shape_gguf --list

What is written, for a shape of `models/known_shapes.py` (`llama-3.2-1b`, `llama-3.2-3b`,
`llama-3.1-8b`, `qwen3-4b`, `qwen3-8b`, `tiny`):
- the shape's numbers (hidden, layers, heads, MLP, head_dim, RoPE, tied or untied head) as
  llama.cpp's converter (convert_hf_to_gguf.py) writes its `{arch}.*` keys: `llama` for the
  Llama shapes, `qwen3` for the Qwen3 ones;
- the default model's tokenizer (SmolLM2's byte-level BPE, its `tokenizer.*` keys copied
  from `models.loaders.gguf.default_model_path()`), so the vocabulary is SmolLM2's 49152
  tokens, not the shape's own: the embedding and LM head are [49152, D];
- tensors in the converter's names and layout (`token_embd`, `blk.{i}.attn_q` ...,
  `output` only when untied; 2-D weights F16, norms F32 and all ones; Llama 3.x's RoPE
  scaling as the converter's `rope_freqs.weight` divisors). Weights are N(0, 0.02) from a
  generator seeded by (seed, tensor index), so a file is the same byte for byte on every
  machine. The converter also permutes llama's q/k rows; rows of seeded noise are noise in
  any order, so nothing is permuted here (loaders still undo the permutation, as for a
  converted file).
Tensors are generated and written in chunks of `CHUNK_VALUES` values: an 8B file never
lives in memory. Then `llama-quantize` (its path an argument: bench/llama_cpp/build_peer.sh
builds it) makes each asked-for type from the F16 file, e.g. `llama-3.2-1b-Q4_K_M.gguf`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from models.gguf_reader import GGUFFile
from models.known_shapes import SHAPES

STD = 0.02  # the weights' standard deviation
CHUNK_VALUES = 1 << 24  # values generated and written at once (64 MiB of float32)
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K", "Q4_1", "Q5_K_M")
ARCH = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# The default model's tokenizer keys copied into every file (tokenizer.ggml.* and the template).
TOKENIZER_PREFIXES = ("tokenizer.",)


class _Streamed:
    """What `GGUFWriter.write_tensor_data` needs of an array (`nbytes`, `tofile`), made in
    chunks by a seeded generator instead of held whole."""

    def __init__(self, shape: tuple[int, ...], dtype, seed: tuple[int, int], ones: bool):
        self.shape, self.dtype, self.seed, self.ones = shape, np.dtype(dtype), seed, ones
        self.size = math.prod(shape)
        self.nbytes = self.size * self.dtype.itemsize

    def chunks(self):
        rng = np.random.default_rng(self.seed)
        for start in range(0, self.size, CHUNK_VALUES):
            n = min(CHUNK_VALUES, self.size - start)
            if self.ones:
                yield np.ones(n, self.dtype)
            else:
                yield (rng.standard_normal(n, dtype=np.float32) * np.float32(STD)).astype(self.dtype)

    def tofile(self, fout) -> None:
        for chunk in self.chunks():
            chunk.tofile(fout)

    def array(self) -> np.ndarray:
        """The whole tensor (tests: what the file must hold)."""
        return np.concatenate(list(self.chunks())).reshape(self.shape)


def shape_config(name: str) -> dict:
    """The shape's HF config with the default model's vocabulary size."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = dict(SHAPES[name])
    if cfg["architectures"][0] not in ARCH:
        raise SystemExit(f"shape {name!r} is a {cfg['architectures'][0]}; this tool writes "
                         f"{', '.join(ARCH)} shapes")
    return cfg


def llama3_rope_divisors(cfg: dict) -> np.ndarray | None:
    """convert_hf_to_gguf's `rope_freqs.weight` for a llama3 RoPE scaling (its formula)."""
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def tensor_plan(cfg: dict, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape [out, in] / [n], is_norm) of every parameter, in the
    converter's order."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    qk_norm = ARCH[cfg["architectures"][0]] == "qwen3"
    plan = [("token_embd.weight", (vocab, d), False)]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), True), (b + "attn_q.weight", (heads * hd, d), False),
                 (b + "attn_k.weight", (kv * hd, d), False), (b + "attn_v.weight", (kv * hd, d), False),
                 (b + "attn_output.weight", (d, heads * hd), False)]
        if qk_norm:
            plan += [(b + "attn_q_norm.weight", (hd,), True), (b + "attn_k_norm.weight", (hd,), True)]
        plan += [(b + "ffn_norm.weight", (d,), True), (b + "ffn_gate.weight", (f, d), False),
                 (b + "ffn_up.weight", (f, d), False), (b + "ffn_down.weight", (d, f), False)]
    plan.append(("output_norm.weight", (d,), True))
    if not cfg.get("tie_word_embeddings"):
        plan.append(("output.weight", (vocab, d), False))
    return plan


def streamed_tensors(cfg: dict, vocab: int, seed: int) -> list[tuple[str, _Streamed]]:
    """The parameters as `_Streamed` producers: F16 weights, F32 norms (all ones)."""
    return [(name, _Streamed(shape, np.float32 if norm else np.float16, (seed, i), norm))
            for i, (name, shape, norm) in enumerate(tensor_plan(cfg, vocab))]


def _copy_tokenizer(w: gguf.GGUFWriter, source: GGUFFile) -> int:
    """Copy the tokenizer keys of `source`; returns its vocabulary size."""
    for key, field in source.fields.items():
        if not key.startswith(TOKENIZER_PREFIXES):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), kind)
    return len(source.fields["tokenizer.ggml.tokens"].data)


def write_f16(shape: str, out: Path, seed: int = 0, tokenizer: str | GGUFFile | None = None) -> Path:
    """Write `shape` as an F16 GGUF at `out` (module docstring); returns `out`.
    `tokenizer`: the GGUF (path or open reader) whose tokenizer keys are copied; None: the
    default model's (parsing its 49k tokens and merges takes seconds: callers writing
    several files pass one reader)."""
    from models.loaders.gguf import default_model_path, open_gguf

    cfg = shape_config(shape)
    arch = ARCH[cfg["architectures"][0]]
    source = tokenizer if isinstance(tokenizer, (gguf.GGUFReader, GGUFFile)) else open_gguf(tokenizer or default_model_path())
    w = gguf.GGUFWriter(str(out), arch)
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(f"{shape} random N(0, {STD}) seed {seed}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _copy_tokenizer(w, source)
    w.add_vocab_size(vocab)
    tensors = streamed_tensors(cfg, vocab, seed)
    divisors = llama3_rope_divisors(cfg)
    if divisors is not None:
        w.add_tensor_info("rope_freqs.weight", divisors.shape, divisors.dtype, divisors.nbytes)
    for name, t in tensors:
        w.add_tensor_info(name, t.shape, t.dtype, t.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if divisors is not None:
        w.write_tensor_data(divisors)
    for _, t in tensors:
        w.write_tensor_data(t)
    w.close()
    return out


def quantize(quantizer: str, f16: Path, kind: str, out: Path, threads: int = 2) -> Path:
    """`llama-quantize F16 OUT TYPE THREADS`; raises SystemExit with its output on failure."""
    result = subprocess.run([quantizer, str(f16), str(out), kind, str(threads)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"llama-quantize {kind} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                         f"{result.stderr[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", nargs="?", help="a models/known_shapes.py name (--list shows them)")
    p.add_argument("--out-dir", default="/work/gguf", help="where the files go (default /work/gguf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantizer", help="path of llama.cpp's llama-quantize; without it only the F16 file")
    p.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=QUANT_TYPES, help="llama-quantize types")
    p.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    p.add_argument("--drop-f16", action="store_true", help="delete the F16 file once quantized")
    p.add_argument("--list", action="store_true", help="list the shapes this tool writes")
    args = p.parse_args(argv)
    if args.list or not args.shape:
        for name, cfg in SHAPES.items():
            if cfg["architectures"][0] in ARCH:
                print(f"{name:14s} {ARCH[cfg['architectures'][0]]:6s} D {cfg['hidden_size']} L "
                      f"{cfg['num_hidden_layers']} H {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} "
                      f"F {cfg['intermediate_size']} tied {bool(cfg.get('tie_word_embeddings'))}")
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"{args.shape}-F16.gguf"
    if f16.exists():
        print(f"{f16} exists; reusing it", file=sys.stderr)
    else:
        t0 = time.perf_counter()
        write_f16(args.shape, f16.with_suffix(".partial"), args.seed).rename(f16)
        print(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    if args.quantizer:
        for kind in args.types:
            t0 = time.perf_counter()
            out = quantize(args.quantizer, f16, kind, out_dir / f"{args.shape}-{kind}.gguf", args.threads)
            print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
        if args.drop_f16:
            f16.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
