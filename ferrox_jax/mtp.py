"""`--speculative mtp`: a checkpoint's own multi-token-prediction layer drafts: DeepSeek-V3's
(`models/deepseek_mtp.py`) or the `mtp.*` block of Qwen3.5, Qwen3.5-MoE and Qwen3-Next
(`models/qwen3_5_mtp.py`, `QWEN_ARCHITECTURES`).

The MTP layer predicts x_{i+2} from the target's final hidden state h_i and the token
x_{i+1} (module docstrings there); both give `draft_step` (one-token rows over the layer's
cache) and `logits`. It has a cache of its own, one layer (DeepSeek's: one latent head, no
V; Qwen's: K and V of the model's full-attention shape, `mtp_layout`), whose
*block ids are the target's* (as the draft model's, `ferrox_jax/draft.py`): block b holds
the layer's entries for the positions block b of the target cache holds, the one
BlockBudget counts both (`ferrox_jax/engine_builder.py` sizes a block as the sum), and a
cancelled row frees nothing of its own.

Each tick, in the owner's order (`ferrox_jax/batcher.py`):

  * `propose(plan)`, before the target's host batch: for a decoding row at position p
    (its last token x_p, not yet computed), step 0 runs the layer at position p - 1 on
    (x_p, h_{p-1}) and samples d_1; step j on (d_j, the layer's own output of step j - 1)
    at position p - 1 + j samples d_{j+1} (k > 1 reuses the one layer, as vLLM does).
    A draft is sampled with the row's settings and the noise of the position it would
    occupy (p + j + 1), so a seeded row's draft is coupled to the target's sample there.
    h_{p-1} is the target's output of the last step, kept on the device (below); a row
    whose last step left none (preempted and recomputed) gets no drafts this step.
  * `follow(plan, batch, pending, arrays)`, after the target's step was sampled: the layer
    runs over every token the step computed (one-token rows, `ForwardResult.hidden`, the
    target's final hidden state of each token, with the token that follows it: the next
    prompt token, or what the step sampled after it), writing its cache where the
    target wrote its own; and the hidden states of the positions the step sampled after
    are kept (`_kept`, on the device) for the next `propose`. For a verifying row the
    token after position p + j is the sample there, which equals draft d_{j+1} wherever
    it was accepted and is the correction at the first rejection: the accepted positions
    get exactly their right entries; the rest lie past the row's length and are written
    again before anything attends to them (as in the target's cache).

A target with recurrent layers (Qwen3.5's Gated DeltaNet) needs nothing more here: its state
pool keeps 1 + k entries a slot and continues from the last accepted one (`models/deltanet.py`,
"Speculation"); the layer itself is an attention layer, rolled back by its positions.

Exactness is the verification's (`ferrox_jax/speculative.py`): the output is the target's
own sample at every position, greedy or seeded, whatever the drafts are.

Shapes: `follow` compiles once per target step token count, `propose` once per row bucket;
`warmup` compiles all of them, later compiles are counted in `recompiles_after_warmup`.
Multi-host serving, LoRA slots and the host KV tier are refused with it at load.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ferrox_jax.host_batch import HostBatch, SamplingArrays, StepArrays
from ferrox_jax.kv_cache import KVCache, copy_blocks, create_layout_kv_cache, layout_bytes_per_block
from ferrox_jax.padding import host_token_index
from ferrox_jax.plan import StepPlan
from ferrox_jax.sampling import sample
from ferrox_jax.step import ForwardBatch
from models import deepseek_mtp, qwen3_5_mtp

DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
QWEN_ARCHITECTURES = qwen3_5_mtp.ARCHITECTURES


def _reader(cfg):
    """The module that reads and runs `cfg`'s MTP layer."""
    return qwen3_5_mtp if cfg.architecture in QWEN_ARCHITECTURES else deepseek_mtp


def mtp_layout(cfg) -> tuple[tuple[int, int, int], ...]:
    """The MTP layer's cache: DeepSeek's one latent head of kv_lora_rank + qk_rope_head_dim, no
    V; Qwen's one K/V pair of its full-attention layers' shape."""
    if cfg.architecture in QWEN_ARCHITECTURES:
        return qwen3_5_mtp.mtp_layout(cfg)
    return ((1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0),)


def mtp_bytes_per_block(cfg, block_size: int, kv_dtype) -> int:
    return layout_bytes_per_block(mtp_layout(cfg), block_size, kv_dtype)


def check_mtp(config, source, model_axis: int) -> bool:
    """Whether `config` asks for `--speculative mtp`; raises ValueError naming why it cannot
    run with this checkpoint or these settings (before anything is allocated)."""
    spec = config.speculative
    if spec is None or spec.method != "mtp":
        return False
    arch = source.config.architecture
    if arch not in DEEPSEEK_ARCHITECTURES + QWEN_ARCHITECTURES:
        raise ValueError(f"--speculative mtp drafts with a checkpoint's own multi-token-prediction layer "
                         f"(DeepSeek-V3, Qwen3.5, Qwen3.5-MoE, Qwen3-Next); {source.name} is a {arch}: use "
                         "--speculative ngram or --speculative draft")
    if source.is_synthetic or not (Path(source.path).is_dir() or Path(source.path).suffix == ".gguf"):
        raise ValueError(f"--speculative mtp reads the MTP layer from the checkpoint (a safetensors folder, or a GGUF "
                         f"file's nextn block); {source.name} has no weights to read: use --speculative ngram")
    if jax.process_count() > 1 or model_axis > 1:
        raise ValueError("--speculative mtp runs on one device for now: drop --tensor-parallel-size / multi-host")
    if config.max_loras or config.kv_offload_gib:
        raise ValueError("--speculative mtp does not combine with --max-loras or --kv-offload-gib yet")
    _reader(source.config).mtp_tensors(Path(source.path), source.config)  # raises naming what is missing
    return True


def build_mtp(source, target_model, dtype, runner) -> "MtpDraft":
    """The MTP draft of `source` (a checkpoint `check_mtp` accepted) over `runner`'s geometry."""
    return MtpDraft(_reader(source.config).load_mtp(source.path, source.config, target_model, dtype), runner)


def _follow_body(graphdef, state, k_cache, v_cache, tokens, positions, valid, tables, hidden, keep):
    model = nnx.merge(graphdef, state)
    _, k_cache, v_cache = model.draft_step(tokens, positions, valid, hidden, k_cache, v_cache, tables)
    return k_cache, v_cache, hidden[keep].astype(jnp.float32)


def _propose_body(graphdef, state, k_cache, v_cache, tokens, positions, valid, tables, hidden, sampling):
    model = nnx.merge(graphdef, state)
    x, k_cache, v_cache = model.draft_step(tokens, positions, valid, hidden, k_cache, v_cache, tables)
    drafted = sample(model.logits(x), positions + 2, sampling)[0]  # x_{i+2}: the noise of its position
    return k_cache, v_cache, x.astype(jnp.float32), drafted


_follow_jit = jax.jit(_follow_body, static_argnums=0, donate_argnums=(2, 3))
_propose_jit = jax.jit(_propose_body, static_argnums=0, donate_argnums=(2, 3))
_copy_jit = jax.jit(copy_blocks, donate_argnums=0)
COPY_BATCH = 8


class MtpDraft:
    """The MTP proposer over a target `ModelRunner`'s geometry (blocks, table width, shapes)."""

    def __init__(self, model, target) -> None:
        self.graphdef, self.state = nnx.split(model)
        self.hidden_size = model.cfg.hidden_size
        self.geometry = target.geometry
        self.vocab_size = target.geometry.vocab_size
        self.cache = create_layout_kv_cache(mtp_layout(model.cfg), target.num_blocks, target.block_size,
                                            target.kv_dtype)
        shapes = target.buckets.shapes()
        self._token_sizes = sorted({s.num_tokens for s in shapes})
        self._keep = max(s.num_rows for s in shapes)  # positions a step samples after, at most
        self._row_sizes = sorted({1 << i for i in range(max(1, self._keep).bit_length() + 1)
                                  if (1 << i) < 2 * self._keep})
        self._compiled: set[tuple] = set()
        self._warm = False
        self._recompiles = 0
        self._kept = jnp.zeros((self._keep, self.hidden_size), jnp.float32)
        self._kept_at: dict[tuple[int, int], int] = {}  # (row id, position) -> row of _kept
        self._copies_done = False

    # ---- shapes ------------------------------------------------------------------------
    @property
    def recompiles_after_warmup(self) -> int:
        return self._recompiles

    def _count(self, key: tuple) -> None:
        if key not in self._compiled:
            self._compiled.add(key)
            self._recompiles += self._warm

    def warmup(self) -> float:
        """Run every shape once on the null block (writes only block 0)."""
        t0 = time.perf_counter()
        for n in self._token_sizes:
            self._run_follow(*self._padding(n), np.zeros(self._keep, np.int32),
                             jnp.zeros((n, self.hidden_size), jnp.float32))  # ForwardResult.hidden's
        for r in self._row_sizes:
            tokens, positions, valid, tables = self._padding(r)
            self._run_propose(tokens, positions, valid, tables, self._kept[jnp.zeros(r, jnp.int32)],
                              SamplingArrays.padding(r, self.vocab_size))  # the gather of step 0 too
        self._warm = True
        return time.perf_counter() - t0

    def _padding(self, n: int):
        return (np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool),
                np.zeros((n, self.geometry.table_width), np.int32))

    def _run_follow(self, tokens, positions, valid, tables, keep, hidden):
        self._count(("mtp_follow", len(tokens)))
        k, v, kept = _follow_jit(self.graphdef, self.state, self.cache.k[0], self.cache.v[0], tokens, positions,
                                 valid, tables, hidden, keep)
        self.cache = KVCache(k=(k,), v=(v,))
        return kept

    def _run_propose(self, tokens, positions, valid, tables, hidden, sampling):
        self._count(("mtp_propose", len(tokens)))
        k, v, x, drafted = _propose_jit(self.graphdef, self.state, self.cache.k[0], self.cache.v[0], tokens,
                                        positions, valid, tables, hidden, sampling)
        self.cache = KVCache(k=(k,), v=(v,))
        return x, drafted

    def _copy(self, copies) -> None:
        copies = np.asarray(copies, np.int32).reshape(-1, 2)
        for i in range(0, len(copies), COPY_BATCH):
            part = np.zeros((COPY_BATCH, 2), np.int32)
            part[:len(copies[i:i + COPY_BATCH])] = copies[i:i + COPY_BATCH]
            self._count(("copy",))
            self.cache = _copy_jit(self.cache, jnp.asarray(part[:, 0]), jnp.asarray(part[:, 1]))

    # ---- the tick ----------------------------------------------------------------------
    def check_compatible(self, target) -> None:
        if target.geometry != self.geometry or target.num_blocks != self.cache.num_blocks:
            raise ValueError("the MTP draft was built for another runner's blocks or geometry")

    def mirror(self, batch: HostBatch) -> None:
        """Nothing while the target's forward runs: the layer needs what the step samples (`follow`)."""

    def propose(self, plan: StepPlan) -> list[tuple[int, ...]]:
        """Each of `plan.draft_requests`' drafts (module docstring); () for a row with no
        kept hidden state."""
        if plan.block_copies:  # a row's last block may be a copy-on-write destination
            self._copy(plan.block_copies)
            self._copies_done = True
        requests = plan.draft_requests
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if (r.row.row_id, self.hidden_position(r.row)) in self._kept_at]
        if not active:
            return [()] * len(requests)
        size = next(s for s in self._row_sizes if s >= len(active))
        select = np.zeros(size, np.int32)
        select[:len(active)] = [self._kept_at[(requests[i].row.row_id, self.hidden_position(requests[i].row))]
                                for i in active]
        hidden = self._kept[jnp.asarray(select)]
        tables = np.zeros((size, self.geometry.table_width), np.int32)
        params = [None] * size
        for slot, i in enumerate(active):
            row = requests[i].row
            tables[slot, :len(row.block_ids)] = row.block_ids[:self.geometry.table_width]
            params[slot] = dataclasses.replace(row.sampling, logprobs=None)
        sampling = SamplingArrays.build(params, [()] * size, [requests[i].row.num_prompt_tokens for i in active]
                                        + [0] * (size - len(active)), self.vocab_size)
        for j in range(max(requests[i].num_drafts for i in active)):
            tokens, positions, valid = np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(size, bool)
            for slot, i in enumerate(active):
                row = requests[i].row
                tokens[slot] = row.token_ids[-1] if j == 0 else drafts[i][-1]
                positions[slot] = row.start_pos - 1 + j
                valid[slot] = requests[i].num_drafts > j
            hidden, drafted = self._run_propose(tokens, positions, valid, tables, hidden, sampling)
            for slot, token in enumerate(np.asarray(drafted)[:len(active)].tolist()):
                if valid[slot]:
                    drafts[active[slot]].append(int(token))
        return [tuple(d) for d in drafts]

    @staticmethod
    def hidden_position(row) -> int:
        """Whose target hidden state drafts a row computing its last token at `row.start_pos`:
        the position before, the last one the target computed (the tests move it to show the
        counters notice a wrong one)."""
        return row.start_pos - 1

    def follow(self, plan: StepPlan, batch: HostBatch, pending, arrays: StepArrays) -> None:
        """After the target's step (module docstring): the layer's cache over the step's
        tokens, and the hidden states of the positions it sampled after kept."""
        if len(batch.block_copies) and not self._copies_done:
            self._copy(batch.block_copies)
        self._copies_done = False
        fwd: ForwardBatch = pending.inputs
        n = len(fwd.tokens)
        index = host_token_index(batch, pending.shape, pending.order)
        following = np.full(n, -1, np.int32)
        keep = np.zeros(self._keep, np.int32)
        kept_at: dict[tuple[int, int], int] = {}
        for h, row in enumerate(plan.rows):
            lo, hi = batch.row_starts[h], batch.row_starts[h + 1]
            flat = index[lo:hi]
            sampled = arrays.tokens[h]
            if batch.num_logits[h] == hi - lo:  # sampled after every token: decode / verification
                following[flat] = sampled[:hi - lo]
                after = flat
            else:  # a prompt chunk: the next prompt token, or the sample after its last
                following[flat[:-1]] = batch.token_ids[lo + 1:hi]
                following[flat[-1]] = sampled[0] if batch.num_logits[h] else row.next_token_id
                after = flat[-1:] if batch.num_logits[h] else flat[:0]
            for t in after:
                slot = len(kept_at)
                if slot < self._keep:
                    keep[slot] = t
                    kept_at[(row.row_id, int(fwd.positions[t]))] = slot
        valid = np.asarray(fwd.valid) & (following >= 0)
        tables = np.concatenate([*fwd.block_tables, np.zeros((1, self.geometry.table_width), np.int32)])
        self._kept = self._run_follow(np.maximum(following, 0), np.asarray(fwd.positions), valid,
                                      tables[np.asarray(fwd.row_of_token)], keep, pending.result.hidden)
        self._kept_at = kept_at
