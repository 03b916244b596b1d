"""A float32 reference of a GGUF model too big to hold in float32: streamed one layer at a time.

    python -m tools.parity.streamed_reference --model X.gguf \\
        --along ours.npz ref-for-ours.npz --along llamacpp.npz ref-for-llamacpp.npz

`compare_logits.py --reference float32` dequantizes the whole model into float32 (12.8 GiB
for Llama 3.2 3B, 32 GiB for Llama 3.1 8B). This tool computes the same logits holding only
one layer's float32 weights at a time: every sequence goes through the model together, one
layer after the other; a layer's weights are dequantized from the GGUF by the loader's own
producers (`models/loaders/gguf.py:gguf_tensors`: the same dequantizers, q/k un-permutation
and fused-tensor splits the float32 model is built from), placed, run over the hidden states
of every position of every sequence, and dropped before the next. The layer itself is the
model's own decoder layer (`models/decoder.py`), over a paged KV cache of that layer alone,
so the arithmetic is the float32 model's (the batching differs: logits agree to ~1e-5, not
bit for bit). The embedding is read for the sequences' token ids only and the LM head a few
thousand vocabulary rows at a time. Peak memory: one layer's float32 weights (0.8 GiB at
8B) plus one head chunk, the hidden states [sequences x positions, D] and the logits of
every position [positions, V] (the output itself).

The greedy continuation. A greedy reference needs one forward per token; streamed, each one
would dequantize the whole model again (at 8B about 5 minutes on this host's two cores, so
30 tokens cost over two hours). Instead each `--along F OUT` teacher-forces the continuation that
F (a reference-format file from the engine being measured: `compare_logits.py --save-ours`,
`llamacpp_logits.py`) chose: the sequence prompt + F's greedy tokens runs once, and OUT
records, besides the prompt logits, `greedy_ids` = the reference's argmax at each step along
F's continuation and `along_ids` = that continuation (`models/reference.py`). Up to the
first step where the two differ the prefixes are identical, so the reference's own greedy
continuation is known exactly up to and including that step, and the leading greedy
agreement `compare_logits.py --reference-file OUT --ours-file F` reports is exact for F's
engine (for another engine it is exact as long as it stays on F's path, else a lower bound).
The tool also prints, per along file, the top-1 agreement over the continuation positions:
the fraction of F's continuation tokens the reference also ranks first given the same
prefix (a position after a disagreement still counts, judged on F's own prefix), and the
parting gap: the reference's log-prob of its own choice minus that of F's token at the
first step they differ.

All along files must hold the same prompts (token ids); their sequences share one pass.
Without `--along`, `--prompt` / `--prompts-file` (tokenized by the GGUF's tokenizer as
compare_logits does) and `--out F` give the prompt logits alone.

Families whose decoder is the shared skeleton (embed -> layers -> final norm -> head) are
supported; others (a custom forward, renamed global tensors) are refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Callable

import numpy as np

from models.reference import PromptReference, load_reference, save_reference

HEAD_ROWS = 8192  # vocabulary rows of the LM head dequantized at a time (8192 x 4096 f32: 128 MiB)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _memory() -> str:
    """This process's resident memory, anonymous (ours) and file-backed (the GGUF's mapped
    pages, given back after each layer), from /proc (Linux; elsewhere nothing)."""
    try:
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    except OSError:
        return ""
    gib = lambda key: int(status.get(key, "0 kB").split()[0]) / 2**20  # noqa: E731
    return f"anon {gib('RssAnon'):.2f} GiB, file {gib('RssFile'):.2f} GiB, peak {gib('VmHWM'):.2f} GiB"


class StreamedModel:
    """A GGUF file's config, lazy float32 tensors and abstract model, placed a layer at a time.

    `tensors` maps our parameter names to producers of float32 arrays in our layout
    (`gguf_tensors`); a caller may replace entries (the tests' negative control does).
    """

    def __init__(self, path: str):
        import jax.numpy as jnp

        from models.config import UnsupportedModelError
        from models.decoder import CausalLM
        from models.loaders.common import abstract_model
        from models.loaders.gguf import config_from_gguf, gguf_tensors, open_gguf
        from models.registry import family_for
        from models.tokenizer import Tokenizer

        self.reader = open_gguf(path)
        self.cfg = config_from_gguf(self.reader)
        family = family_for(self.cfg.architecture)
        self.model = abstract_model(self.cfg, jnp.float32)
        if type(self.model).__call__ is not CausalLM.__call__ or family.gguf_global_weights:
            raise UnsupportedModelError(f"{self.cfg.architecture}: the streamed reference runs the shared decoder "
                                        "skeleton only; this family has its own forward or global tensors")
        self.tokenizer = Tokenizer.from_gguf(self.reader)
        self.tensors: dict[str, Callable[[], np.ndarray]] = gguf_tensors(self.reader, self.cfg)
        by_name = {t.name: t for t in self.reader.tensors}
        self.embed_tensor = by_name["token_embd.weight"]
        head = "token_embd.weight" if self.cfg.tie_word_embeddings else "output.weight"
        self.head_tensor = by_name[head]
        self._steps: dict = {}

    def rows(self, tensor, ids) -> np.ndarray:
        """f32[len(ids), D]: rows `ids` (an index array or a slice) of a [V, D] tensor, through
        the same `gguf.quants.dequantize` the loader uses (a row is whole blocks)."""
        from gguf.quants import dequantize

        data = np.asarray(tensor.data[ids])
        return dequantize(data, tensor.tensor_type).reshape(data.shape[0], -1).astype(np.float32, copy=False)

    def layer_step(self, graphdef):
        """The jitted forward of one layer of this structure (one compile per distinct layer)."""
        import jax

        if graphdef not in self._steps:
            from flax import nnx

            from models.layers import ForwardContext

            rope = self.model.rope

            def step(state, x, positions, valid, tables, k_cache, v_cache):
                layer = nnx.merge(graphdef, state)
                tokens = positions.shape[0] // tables.shape[0]
                fwd = ForwardContext.build(positions, valid, (tables,), (tokens,), k_cache.shape[2], rope, None)
                x, _, _ = layer(x, fwd, k_cache, v_cache)
                return x

            self._steps[graphdef] = jax.jit(step)
        return self._steps[graphdef]


def stream_logits(sm: StreamedModel, sequences: list[list[int]], block_size: int = 16,
                  progress: Callable[[str], None] | None = None) -> list[np.ndarray]:
    """f32[len(s), V] per sequence: the float32 model's logits after each token, computed a
    layer at a time (module docstring). All sequences run together, padded to the longest."""
    import jax.numpy as jnp
    from flax import nnx

    from models.attention import ATTENTION_CHUNK_BLOCKS
    from models.loaders.common import param_name
    from models.loaders.gguf import release_pages

    cfg, model = sm.cfg, sm.model
    lengths = [len(s) for s in sequences]
    if not sequences or min(lengths) == 0:
        raise ValueError("every sequence needs at least one token")
    bad = [t for s in sequences for t in s if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {cfg.vocab_size}")
    rows, width = len(sequences), max(lengths)
    tokens = np.zeros((rows, width), np.int64)
    valid = np.zeros((rows, width), bool)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
        valid[i, :len(s)] = True
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
    per_row = math.ceil(width / block_size)
    # Each row its own blocks (0 is the null block); the width padded with null blocks to
    # the attention's walk (`models/attention.py`: whole chunks of ATTENTION_CHUNK_BLOCKS).
    tables = np.zeros((rows, -(-per_row // ATTENTION_CHUNK_BLOCKS) * ATTENTION_CHUNK_BLOCKS), np.int32)
    tables[:, :per_row] = 1 + np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    tables = jnp.asarray(tables)
    num_blocks = rows * per_row + 1
    flat_pos, flat_valid = jnp.asarray(positions.reshape(-1)), jnp.asarray(valid.reshape(-1))

    # The embedding: only the rows of the token ids used, looked up through the model's own
    # embed_tokens (a family's scaling applies) with the ids renumbered into that table.
    used, index = np.unique(tokens, return_inverse=True)
    model.embed.set_value(jnp.asarray(sm.rows(sm.embed_tensor, used)))
    x = model.embed_tokens(jnp.asarray(index.reshape(-1).astype(np.int32)))
    model.embed.set_value(None)

    layout = cfg.kv_layout()
    for i, layer in enumerate(model.layers):
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        if nnx.to_flat_state(rest):
            raise ValueError(f"layer {i} holds state other than parameters, which the streamed reference cannot fill")
        # New Variables holding the values (`replace`): the split's entries are the model's
        # own, and filling those would keep every layer's weights alive.
        flat = []
        for path, var in nnx.to_flat_state(params):
            name = f"layers.{i}.{param_name(path)}"
            value = np.asarray(sm.tensors[name]())
            if tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(var.shape)}")
            flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
            del value
        heads, k_dim, v_dim = layout[i]
        k_cache = jnp.zeros((heads, num_blocks, block_size, k_dim), jnp.float32)
        v_cache = jnp.zeros((heads, num_blocks, block_size, v_dim), jnp.float32)
        x = sm.layer_step(graphdef)(nnx.from_flat_state(flat), x, flat_pos, flat_valid, tables, k_cache, v_cache)
        x.block_until_ready()
        release_pages(sm.reader)  # the file's pages this layer brought in
        del flat, params, k_cache, v_cache  # this layer's weights go before the next is read
        if progress:
            progress(f"layer {i + 1}/{cfg.num_layers}")

    hidden = model.norm(x, jnp.asarray(sm.tensors["final_norm"](), jnp.float32))
    hidden = hidden[jnp.asarray(np.flatnonzero(valid.reshape(-1)))]  # real positions only
    logits = np.empty((hidden.shape[0], cfg.vocab_size), np.float32)
    head_var = model.tied_lm_head if cfg.tie_word_embeddings else model.lm_head
    for start in range(0, cfg.vocab_size, HEAD_ROWS):
        stop = min(start + HEAD_ROWS, cfg.vocab_size)
        head_var.set_value(jnp.asarray(sm.rows(sm.head_tensor, slice(start, stop)).T))
        logits[:, start:stop] = np.asarray(model.logits(hidden))
    head_var.set_value(None)
    return np.split(logits, np.cumsum(lengths)[:-1])


# ---- teacher-forced references --------------------------------------------------------------


@dataclasses.dataclass
class AlongSummary:
    """One along file's continuation against the reference: per prompt, the leading greedy
    agreement (exact for that file's engine) and the top-1 agreement over its continuation."""

    path: str
    greedy_match: list[int]
    greedy_tokens: list[int]
    continuation_top1: list[float]
    # At the first step the reference leaves the continuation: log p(its argmax) - log p(the
    # continuation's token), in nats (a near-tie is small); None where it never leaves.
    parting_gap: list[float | None]


def along_references(prompt_logits: list[np.ndarray], along: list[PromptReference],
                     sequence_logits: list[np.ndarray]) -> list[PromptReference]:
    """The reference for one along file: each prompt's logits (`prompt_logits`), and the
    argmax of the reference at each continuation step (`sequence_logits`: the logits of
    prompt + continuation[:-1]) as greedy_ids, with the continuation as along_ids."""
    out = []
    for p_logits, a, s_logits in zip(prompt_logits, along, sequence_logits):
        n, g = len(a.token_ids), len(a.greedy_ids)
        argmax = s_logits[n - 1:n - 1 + g].argmax(axis=-1).astype(np.int64).tolist()
        out.append(PromptReference(list(a.token_ids), a.text, logits=p_logits, greedy_ids=argmax,
                                   along_ids=list(a.greedy_ids)))
    return out


def summarize(path: str, refs: list[PromptReference], sequence_logits: list[np.ndarray]) -> AlongSummary:
    from models.reference import common_prefix_len, greedy_known_prefix, log_softmax

    match = [common_prefix_len(r.along_ids, greedy_known_prefix(r)) for r in refs]
    top1 = [float(np.mean(np.asarray(r.greedy_ids) == np.asarray(r.along_ids))) for r in refs]
    gaps = []
    for r, m, s_logits in zip(refs, match, sequence_logits):
        if m == len(r.along_ids):
            gaps.append(None)
            continue
        logp = log_softmax(s_logits[len(r.token_ids) - 1 + m])
        gaps.append(float(logp[r.greedy_ids[m]] - logp[r.along_ids[m]]))
    return AlongSummary(path, match, [len(r.along_ids) for r in refs], top1, gaps)


def run_along(sm: StreamedModel, pairs: list[tuple[str, str]], block_size: int = 16,
              progress=None) -> list[AlongSummary]:
    """Teacher-force every along file's continuations in one streamed pass; write each OUT."""
    alongs = [load_reference(src) for src, _ in pairs]
    first = alongs[0]
    for (src, _), refs in zip(pairs, alongs):
        if [r.token_ids for r in refs] != [r.token_ids for r in first]:
            raise ValueError(f"{src}: its prompts' token ids differ from {pairs[0][0]}'s; along files must share "
                             "their prompts")
        if any(not r.greedy_ids for r in refs):
            raise ValueError(f"{src}: a prompt has no greedy continuation to teacher-force")
    sequences = [list(r.token_ids) + list(r.greedy_ids[:-1]) for refs in alongs for r in refs]
    logits = stream_logits(sm, sequences, block_size, progress)
    n = len(first)
    prompt_logits = [lg[:len(r.token_ids)] for lg, r in zip(logits[:n], first)]
    summaries = []
    for k, ((src, dst), refs) in enumerate(zip(pairs, alongs)):
        out = along_references(prompt_logits, refs, logits[k * n:(k + 1) * n])
        save_reference(dst, out)
        summaries.append(summarize(src, out, logits[k * n:(k + 1) * n]))
    return summaries


# ---- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.parity.streamed_reference",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--along", nargs=2, action="append", default=[], metavar=("F", "OUT"),
                   help="teacher-force F's greedy continuations (a reference-format file) and write the "
                        "reference for F to OUT (repeatable; one pass for all)")
    p.add_argument("--prompt", action="append", default=[], help="without --along: a prompt (repeatable)")
    p.add_argument("--prompts-file", metavar="F", help="without --along: prompts, one per line or a JSON list")
    p.add_argument("--chat", action="store_true", help="without --along: wrap each prompt in the chat template")
    p.add_argument("--out", metavar="F", help="without --along: where the prompt logits go (.npz or .json)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the per-layer cache")
    args = p.parse_args(argv)
    if bool(args.along) == bool(args.out) or (args.along and (args.prompt or args.prompts_file or args.chat)):
        p.error("give either --along F OUT (repeatable) or --out F with --prompt / --prompts-file")
    t0 = time.perf_counter()
    try:
        sm = StreamedModel(args.model)
        _log(f"{args.model}: {sm.cfg.num_layers} layers, streamed in float32")
        progress = lambda m: _log(f"  {m} ({time.perf_counter() - t0:.0f} s; {_memory()})")  # noqa: E731
        if args.along:
            summaries = run_along(sm, [tuple(a) for a in args.along], args.block_size, progress)
            print(json.dumps({"model": args.model, "elapsed_s": round(time.perf_counter() - t0, 1),
                              "along": [dataclasses.asdict(s) for s in summaries]}))
            return 0
        from tools.parity.compare_logits import DEFAULT_PROMPTS, encode_prompt, read_prompts_file

        texts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
        texts = texts or list(DEFAULT_PROMPTS)
        ids = [encode_prompt(sm.tokenizer, t, args.chat) for t in texts]
        logits = stream_logits(sm, ids, args.block_size, progress)
        save_reference(args.out, [PromptReference(i, t, logits=lg) for t, i, lg in zip(texts, ids, logits)])
        _log(f"wrote {len(ids)} prompts to {args.out} ({time.perf_counter() - t0:.0f} s)")
        return 0
    except (ValueError, FileNotFoundError) as e:
        _log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
