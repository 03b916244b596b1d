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

Tensor parallelism. On the target runner's mesh the layer splits as the family's own layer
of its kind does (`ferrox_jax/sharding.py`): its attention (or latent attention) heads, its
MLP or experts (by width, or by expert when the target's run `--expert-parallel`), its
shared embedding and LM head are the target's arrays, placed as they are; fc / eh_proj
[2D, D] splits its output columns, so its product needs no partial sums (each device the
exact D/M outputs, one all-gather of [R, D] before the layer's norm). Its one-layer cache
splits its K/V heads as the target's cache does (a latent cache is one head, replicated
like the target's). The hidden states it reads are the target step's, replicated as every
step result is; what it keeps and returns is replicated, so each call takes what the last
one gave in the same shardings and the compiled steps stay those of the warm-up. The
compiled steps add the layer's own collectives and nothing else (the families sharding
probe counts them).

Multi-host serving, LoRA slots and the host KV tier are refused with it at load: on a
multi-process mesh every process would have to run each `follow` and `propose` with the
same inputs, which the step channel does not carry yet (it carries the target's batch
and a draft model's proposal batches, not the MTP layer's rows).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ferrox_jax.host_batch import HostBatch, SamplingArrays, StepArrays
from ferrox_jax.kv_cache import KVCache, copy_blocks, create_layout_kv_cache, layout_bytes_per_block
from ferrox_jax.multihost import place_on_mesh
from ferrox_jax.padding import host_token_index
from ferrox_jax.plan import StepPlan
from ferrox_jax.sampling import sample
from ferrox_jax.sharding import MODEL_AXIS, runner_shardings
from ferrox_jax.step import ForwardBatch
from models import deepseek_mtp, qwen3_5_mtp
from models.moe_ep import point_layer_at_mesh, uses_expert_parallel

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
    if jax.process_count() > 1:
        raise ValueError("--speculative mtp is not served across processes yet (multi-host): run it on one host "
                         "(with --tensor-parallel-size over its devices), or use --speculative ngram")
    if model_axis > 1 and source.config.hidden_size % model_axis:
        raise ValueError(f"--speculative mtp: tensor parallelism {model_axis} does not divide the model's hidden_size "
                         f"{source.config.hidden_size} (the MTP layer's fc splits its outputs over the devices); "
                         "choose a size dividing it")
    if config.max_loras or config.kv_offload_gib:
        raise ValueError("--speculative mtp does not combine with --max-loras or --kv-offload-gib yet")
    _reader(source.config).mtp_tensors(Path(source.path), source.config)  # raises naming what is missing
    return True


def build_mtp(source, target_model, dtype, runner) -> "MtpDraft":
    """The MTP draft of `source` (a checkpoint `check_mtp` accepted) over `runner`'s geometry
    (and mesh: its experts split by expert when `target_model`'s are)."""
    return MtpDraft(_reader(source.config).load_mtp(source.path, source.config, target_model, dtype), runner,
                    expert_parallel=uses_expert_parallel(target_model))


def _follow_body(graphdef, state, k_cache, v_cache, tokens, positions, valid, tables, hidden, keep):
    model = nnx.merge(graphdef, state)
    _, k_cache, v_cache = model.draft_step(tokens, positions, valid, hidden, k_cache, v_cache, tables)
    return k_cache, v_cache, hidden[keep].astype(jnp.float32)


def _propose_body(graphdef, state, k_cache, v_cache, tokens, positions, valid, tables, hidden, sampling):
    model = nnx.merge(graphdef, state)
    x, k_cache, v_cache = model.draft_step(tokens, positions, valid, hidden, k_cache, v_cache, tables)
    drafted = sample(model.logits(x), positions + 2, sampling)[0]  # x_{i+2}: the noise of its position
    return k_cache, v_cache, x.astype(jnp.float32), drafted


def _gather_body(kept, select):
    return kept[select]


_follow_jit = jax.jit(_follow_body, static_argnums=0, donate_argnums=(2, 3))
_propose_jit = jax.jit(_propose_body, static_argnums=0, donate_argnums=(2, 3))
_copy_jit = jax.jit(copy_blocks, donate_argnums=0)
_gather_jit = jax.jit(_gather_body)
COPY_BATCH = 8


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The draft's jitted calls: the shared plain ones on one device, or its own with explicit
    out shardings on a mesh (module docstring, "Tensor parallelism")."""

    follow: Callable
    propose: Callable
    copy: Callable
    gather: Callable
    replicated: object = None  # NamedSharding of what is replicated (None: one device)

    @classmethod
    def on(cls, shardings) -> "_Steps":
        if shardings is None:
            return cls(_follow_jit, _propose_jit, _copy_jit, _gather_jit)
        kv, rep = shardings.kv_array, shardings.replicated
        return cls(jax.jit(_follow_body, static_argnums=0, donate_argnums=(2, 3), out_shardings=(kv, kv, rep)),
                   jax.jit(_propose_body, static_argnums=0, donate_argnums=(2, 3), out_shardings=(kv, kv, rep, rep)),
                   jax.jit(copy_blocks, donate_argnums=0, out_shardings=kv),
                   jax.jit(_gather_body, out_shardings=rep), rep)

    def place(self, x):
        """`x` where the steps take it: replicated on the mesh (as they return it), or as it is."""
        return x if self.replicated is None else jax.device_put(x, self.replicated)


def place_mtp(model, target, expert_parallel: bool = False):
    """(graphdef, state, shardings) of the MTP `model` on `target`'s mesh, split as the
    family's layer of its kind (module docstring); the shared embedding and LM head are the
    target's placed arrays (placing them again moves nothing). One device: shardings None."""
    if getattr(target, "shardings", None) is None:
        return *nnx.split(model), None
    if expert_parallel:  # the layer's expert stacks split by expert, as the target's are
        point_layer_at_mesh(model.layer, target.mesh)
    # fc's and the head's products split by column, then gathered whole (models/deepseek_mtp.py:gathered)
    model.gather_shardings = (NamedSharding(target.mesh, P(None, MODEL_AXIS)), target.shardings.replicated)
    graphdef, state = nnx.split(model)
    shardings = runner_shardings(target.mesh, model.cfg, state, target.shardings.replicate_attention,
                                 expert_parallel)
    return graphdef, place_on_mesh(state, shardings.state), dataclasses.replace(
        shardings, kv_array=target.shardings.kv_array)


class MtpDraft:
    """The MTP proposer over a target `ModelRunner`'s geometry (blocks, table width, shapes)."""

    def __init__(self, model, target, expert_parallel: bool = False) -> None:
        """`target`: the target's `ModelRunner` (its geometry, blocks and mesh); `expert_parallel`:
        on a mesh, the layer's experts split by expert as the target's are."""
        self.graphdef, self.state, self.shardings = place_mtp(model, target, expert_parallel)
        self._steps = _Steps.on(self.shardings)
        self.hidden_size = model.cfg.hidden_size
        self.geometry = target.geometry
        self.vocab_size = target.geometry.vocab_size
        self.cache = create_layout_kv_cache(mtp_layout(model.cfg), target.num_blocks, target.block_size,
                                            target.kv_dtype,
                                            sharding=None if self.shardings is None else self.shardings.kv_array)
        shapes = target.buckets.shapes()
        self._token_sizes = sorted({s.num_tokens for s in shapes})
        self._keep = max(s.num_rows for s in shapes)  # positions a step samples after, at most
        self._row_sizes = sorted({1 << i for i in range(max(1, self._keep).bit_length() + 1)
                                  if (1 << i) < 2 * self._keep})
        self._compiled: set[tuple] = set()
        self._warm = False
        self._recompiles = 0
        self._kept = self._steps.place(jnp.zeros((self._keep, self.hidden_size), jnp.float32))
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
        for n in self._token_sizes:  # ForwardResult.hidden's shape and placement
            self._run_follow(*self._padding(n), np.zeros(self._keep, np.int32),
                             self._steps.place(jnp.zeros((n, self.hidden_size), jnp.float32)))
        for r in self._row_sizes:
            tokens, positions, valid, tables = self._padding(r)
            self._run_propose(tokens, positions, valid, tables, self._gather(np.zeros(r, np.int32)),
                              SamplingArrays.padding(r, self.vocab_size))  # the gather of step 0 too
        self._warm = True
        return time.perf_counter() - t0

    def _padding(self, n: int):
        return (np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool),
                np.zeros((n, self.geometry.table_width), np.int32))

    def _run_follow(self, tokens, positions, valid, tables, keep, hidden):
        self._count(("mtp_follow", len(tokens)))
        k, v, kept = self._steps.follow(self.graphdef, self.state, self.cache.k[0], self.cache.v[0], tokens, positions,
                                 valid, tables, hidden, keep)
        self.cache = KVCache(k=(k,), v=(v,))
        return kept

    def _run_propose(self, tokens, positions, valid, tables, hidden, sampling):
        self._count(("mtp_propose", len(tokens)))
        k, v, x, drafted = self._steps.propose(self.graphdef, self.state, self.cache.k[0], self.cache.v[0], tokens,
                                        positions, valid, tables, hidden, sampling)
        self.cache = KVCache(k=(k,), v=(v,))
        return x, drafted

    def _copy(self, copies) -> None:
        copies = np.asarray(copies, np.int32).reshape(-1, 2)
        for i in range(0, len(copies), COPY_BATCH):
            part = np.zeros((COPY_BATCH, 2), np.int32)
            part[:len(copies[i:i + COPY_BATCH])] = copies[i:i + COPY_BATCH]
            self._count(("copy",))
            self.cache = self._steps.copy(self.cache, jnp.asarray(part[:, 0]), jnp.asarray(part[:, 1]))

    def _gather(self, select: np.ndarray):
        """The kept hidden states of rows `select` (i32[R]): step 0's hidden input."""
        self._count(("mtp_gather", len(select)))
        return self._steps.gather(self._kept, jnp.asarray(select))

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
        hidden = self._gather(select)
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
