"""`--speculative mtp` from a GGUF file: the multi-token-prediction block llama.cpp's
converter appends as `nextn` layers (models/loaders/gguf_mtp.py), for a tiny Qwen3.5
(`qwen35`), Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`, with experts), the `mtp.*`
block written as `_QwenMtpMixin` does (`blk.{n}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`
beside the layer's tensors, norms stored 1 + w), and a tiny DeepSeek-V3 (`deepseek2`, the
layer written as the converters that keep it do: attn_k_b / attn_v_b, the experts stacked,
`nextn.{eh_proj,enorm,hnorm,shared_head_norm,shared_head_head,embed_tokens}`);
tests/support/gguf_from_hf.py writes the files from the transformers checkpoints.

Checks, per family: the GGUF form's MTP layer output and logits equal the safetensors form's
(float32, random MTP weights with non-trivial norms, 12 positions over the layer's cache;
Qwen3-Next's and Qwen3.5-MoE's blocks with experts too; a Q8_0 Qwen3.5 file beside the
model's own blocks); the model's layer count excludes the block; greedy decoding with the
block's drafts from the GGUF equals greedy without, with drafts accepted (a fitted block:
Qwen3.5's as tests/models/test_mtp_qwen3_5.py fits it, DeepSeek's as tests/models/test_mtp.py
does), and so does the Qwen3.5 file served through the engine builder; a file without the
block is refused for `--speculative mtp` naming what is missing, and a draft file holding
only the block (the converter's `--mtp`) at open. Negative controls: the
reader with enorm and hnorm swapped, and (Qwen3.5) the stored 1 + w norms not shifted back,
move the layer's output far past the tolerance.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from ferrox_jax.config import EngineConfig, SpeculativeConfig
from ferrox_jax.request import Job, RowSampling
from tests.support import family_checks as fc
from tests.support.gguf_from_hf import write_deepseek2_gguf, write_qwen35_gguf
from tests.models.test_mtp_qwen3_5 import layer_tensors
from tests.support.mtp_serving import serve_one_greedy_completion
from tests.support.spec_driver import drive

K = 2
MAX_ROWS = 2
GREEDY = RowSampling(temperature=0.0, logprobs=1)
LAYER_ATOL = 1e-6  # f32 both: the same weights through the same graph
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
                num_nextn_predict_layers=1)


def _spec(k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, max_rows=MAX_ROWS)


def _save(path, extra: dict) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **{k: np.asarray(v, np.float32) for k, v in extra.items()}},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def _ours(module, path, ckpt, tokens, hidden):
    """The MTP layer of `path` (a folder or a GGUF file) over len(tokens) positions of one
    sequence as one-token rows over its cache (blocks out of order) -> (out, logits)."""
    from ferrox_jax.kv_cache import create_layout_kv_cache
    from ferrox_jax.mtp import mtp_layout
    from ferrox_jax.runner import block_table_width

    t = len(tokens)
    model = module.load_mtp(path, ckpt.config, ckpt.model, jnp.float32)
    cache = create_layout_kv_cache(mtp_layout(ckpt.config), 8, 4, jnp.float32)
    tables = np.zeros((t, block_table_width(64, 4)), np.int32)
    tables[:, :3] = [5, 2, 7]
    out, _, _ = model.draft_step(jnp.asarray(tokens, jnp.int32), jnp.arange(t, dtype=jnp.int32), jnp.ones(t, bool),
                                 jnp.asarray(hidden), cache.k[0], cache.v[0], jnp.asarray(tables))
    return np.asarray(out), np.asarray(model.logits(out))


def _diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _swapped(table: dict) -> dict:
    """`table` with the enorm and hnorm entries exchanged (a reader mixing the two norms)."""
    return {**table, "nextn.enorm.weight": table["nextn.hnorm.weight"], "nextn.hnorm.weight": table["nextn.enorm.weight"]}


def _check_parity(module, folder, gguf_path, monkeypatch, name: str, control: bool = True):
    """Asserts the GGUF form's layer equals the folder's, and (`control`) the enorm / hnorm swap
    does not; -> (folder checkpoint, GGUF checkpoint, tokens, hidden states, the folder's (out, logits))."""
    from models.loader import load_checkpoint

    st, gg = load_checkpoint(str(folder)), load_checkpoint(str(gguf_path))
    # the layer count excludes the nextn block (the file keeps rms_norm_eps as a float32)
    assert dataclasses.replace(gg.config, rms_norm_eps=st.config.rms_norm_eps) == st.config
    rng = np.random.RandomState(3)
    tokens, hidden = rng.randint(0, st.config.vocab_size, 12), rng.randn(12, st.config.hidden_size).astype(np.float32)
    want = _ours(module, folder, st, tokens, hidden)
    err = _diff(_ours(module, gguf_path, gg, tokens, hidden), want)
    if not control:
        print(f"{name}: GGUF vs safetensors MTP layer max |Δ| (output, logits) {err:.1e}")
        assert err <= LAYER_ATOL
        return st, gg, tokens, hidden, want
    monkeypatch.setattr(module, "GGUF_MTP_WEIGHTS", _swapped(module.GGUF_MTP_WEIGHTS))
    swapped = _diff(_ours(module, gguf_path, gg, tokens, hidden), want)
    monkeypatch.undo()
    print(f"{name}: GGUF vs safetensors MTP layer max |Δ| (output, logits) {err:.1e}; enorm/hnorm swapped {swapped:.1e}")
    assert err <= LAYER_ATOL and swapped > 1e-2
    return st, gg, tokens, hidden, want


def _fitted_run(runner, ckpt, gguf_path, module, jobs, plain, least_accepted, state_slots: int = 0):
    """Greedy with the file's block drafting = greedy without; `least_accepted(drafted)`: the
    fewest accepted drafts the fitted block makes."""
    from ferrox_jax.mtp import MtpDraft

    draft = MtpDraft(module.load_mtp(gguf_path, ckpt.config, ckpt.model, jnp.float32), runner)
    draft.warmup()
    run = drive(runner, ckpt.tokenizer, jobs, _spec(), max_rows=MAX_ROWS, draft=draft, state_slots=state_slots)
    c = run.scheduler.speculator.counters
    print(f"{gguf_path.name}: {c.num_accepted_tokens}/{c.num_draft_tokens} drafts accepted; "
          f"steps {run.num_steps} vs {plain.num_steps}")
    assert run.tokens == plain.tokens
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens >= least_accepted(c.num_draft_tokens)
    assert run.num_steps < plain.num_steps  # a count of forwards, not a timing
    assert draft.recompiles_after_warmup == 0


def _refused(gguf_path, match: str) -> None:
    from ferrox_jax.mtp import check_mtp
    from models.loader import open_checkpoint

    source = open_checkpoint(str(gguf_path))
    config = EngineConfig(model=str(gguf_path), speculative=_spec())
    with pytest.raises(ValueError, match=match):
        check_mtp(config, source, 1)
    assert not check_mtp(dataclasses.replace(config, speculative=None), source, 1)


# -- Qwen3.5 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(root, folder without the block, its GGUF, runner over the GGUF's model, checkpoint, jobs, plain run)."""
    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint

    root = tmp_path_factory.mktemp("gguf_mtp_qwen")
    folder = fc.make_tiny_qwen3_5(root / "tiny-qwen3_5")
    bare = write_qwen35_gguf(folder, root / "no-mtp.gguf")
    ckpt = load_checkpoint(str(bare))
    ckpt.model.keeps_step_hidden = True
    rows = _spec().step_rows(MAX_ROWS)
    runner = ModelRunner(ckpt.model, max_rows=rows, state_entries=1 + K, num_blocks=64, block_size=8,
                         max_chunk_tokens=8, max_context=128)
    rng = np.random.RandomState(0)
    jobs = [Job(request_id=f"r{i}", prompt_token_ids=tuple(rng.randint(0, 380, n).tolist()), max_tokens=14,
                sampling=GREEDY) for i, n in enumerate((9, 14))]
    plain = drive(runner, ckpt.tokenizer, jobs, None, max_rows=MAX_ROWS, state_slots=rows + 1)
    return root, folder, bare, runner, ckpt, jobs, plain


@pytest.fixture(scope="module")
def qwen_random(qwen):
    """(folder, its f32 GGUF): the tiny Qwen3.5 with a random `mtp.*` block (norms far from 0)."""
    from safetensors.numpy import load_file

    root, folder, *_ = qwen
    random = shutil.copytree(folder, root / "random-mtp")
    tensors = load_file(str(random / "model.safetensors"))
    rng = np.random.RandomState(1)
    d = tensors["model.embed_tokens.weight"].shape[1]
    _save(random, {"mtp.fc.weight": rng.randn(d, 2 * d) / np.sqrt(2 * d),
                   **{f"mtp.{k}.weight": 0.3 * rng.randn(d) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                      "norm")},
                   **layer_tensors(tensors, 1, rng, scale_out=1.0)})  # layer 1: full attention
    return random, write_qwen35_gguf(random, root / "random-mtp.gguf")


def test_qwen3_5_gguf_mtp_layer_equals_the_safetensors_one(qwen_random, monkeypatch):
    from models import qwen3_5_mtp
    from models.loaders.gguf_mtp import gguf_mtp_tensors

    random, path = qwen_random
    _, gg, tokens, hidden, want = _check_parity(qwen3_5_mtp, random, path, monkeypatch, "Qwen3.5")
    # negative control: the nextn norms' stored 1 + w kept
    from models.loaders import gguf_mtp  # imported by the layer module when it reads a GGUF file

    monkeypatch.setattr(gguf_mtp, "gguf_mtp_tensors",
                        lambda *a, **kw: gguf_mtp_tensors(*a, **{**kw, "norm_offset": 0.0}))
    unshifted = _diff(_ours(qwen3_5_mtp, path, gg, tokens, hidden), want)
    print(f"Qwen3.5: nextn norms read as stored (1 + w): max |Δ| {unshifted:.1e}")
    assert unshifted > 1e-2


def test_qwen3_5_q8_0_gguf_mtp_reads_its_blocks_beside_a_block_quantized_model(qwen_random):
    """A Q8_0 file (every 2-D tensor whose rows fill 32-value blocks, the block's too): the MTP
    tensors dequantized as the rest of the file is read, the embedding and LM head shared in the
    form `--quantization gguf` keeps them (their blocks) or dequantized (`none`): the same
    weights, so within 1e-4; against the f32 file the Q8_0 rounding shows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from models import qwen3_5_mtp
    from models.gguf_blocks import BlockQuantizedWeight
    from models.loader import load_checkpoint

    random, f32_path = qwen_random
    q8 = GGMLQuantizationType.Q8_0
    path = write_qwen35_gguf(random, random.parent / "random-mtp-q8_0.gguf", quant=lambda name, arr: (
        (quantize(arr, q8), q8) if arr.ndim == 2 and arr.shape[-1] % 32 == 0 else None))
    blocks, floats = load_checkpoint(str(path), quantization="gguf"), load_checkpoint(str(path))
    assert isinstance(blocks.model.embed.get_value(), BlockQuantizedWeight)
    rng = np.random.RandomState(4)
    tokens, hidden = rng.randint(0, floats.config.vocab_size, 12), rng.randn(12, 64).astype(np.float32)
    ours = _ours(qwen3_5_mtp, path, blocks, tokens, hidden)
    err = _diff(ours, _ours(qwen3_5_mtp, path, floats, tokens, hidden))
    rounding = _diff(ours, _ours(qwen3_5_mtp, f32_path, load_checkpoint(str(f32_path)), tokens, hidden))
    print(f"Qwen3.5 Q8_0 GGUF MTP layer: model's blocks vs dequantized max |Δ| {err:.1e}; vs the f32 file {rounding:.1e}")
    assert err <= 1e-4 and rounding > 1e-4


def test_qwen3_5_mtp_only_draft_file_is_refused_naming_it(qwen_random, tmp_path):
    """The converter's `--mtp` writes the block alone (with the embedding, final norm and LM
    head) as a draft file: not a model; refused at open with what to serve instead, while the
    same folder's full file (the other tests) serves."""
    from models.config import UnsupportedModelError
    from models.loader import open_checkpoint

    path = write_qwen35_gguf(qwen_random[0], tmp_path / "mtp-tiny.gguf", mtp_only=True)
    with pytest.raises(UnsupportedModelError, match=r"mtp-tiny\.gguf holds only a multi-token-prediction block "
                                                    r"\(llama\.cpp's converter run with --mtp"):
        open_checkpoint(str(path))


@pytest.fixture(scope="module")
def qwen_fitted(qwen):
    """The f32 GGUF of the tiny Qwen3.5 with a block fitted to draft the plain replies' next
    tokens (tests/models/test_mtp_qwen3_5.py's construction)."""
    from safetensors.numpy import load_file

    root, folder, _, runner, ckpt, jobs, plain = qwen
    fitted = shutil.copytree(folder, root / "fitted-mtp")
    succ: dict[int, int] = {}
    for rows in plain.tokens.values():
        for x, y in zip(rows[0], rows[0][1:]):
            succ.setdefault(x, y)
    tensors = load_file(str(fitted / "model.safetensors"))
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    d, xs = embed.shape[1], sorted(succ)
    want = np.stack([head[succ[x]] / np.linalg.norm(head[succ[x]]) * np.sqrt(d) for x in xs])
    e = embed[xs] / np.sqrt((embed[xs] ** 2).mean(-1, keepdims=True) + 1e-6)
    fit = np.linalg.lstsq(e, want, rcond=None)[0]  # normed embedding of x -> LM head column of succ(x)
    _save(fitted, {"mtp.fc.weight": np.concatenate([fit.T, np.zeros((d, d))], axis=1),
                   **{f"mtp.{k}.weight": np.zeros(d) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
                   **layer_tensors(tensors, 1, np.random.RandomState(2), scale_out=0.02)})
    return write_qwen35_gguf(fitted, root / "fitted-mtp.gguf")


def test_qwen3_5_greedy_with_gguf_drafts_equals_greedy_without(qwen, qwen_fitted):
    from models import qwen3_5_mtp

    _, _, _, runner, ckpt, jobs, plain = qwen
    _fitted_run(runner, ckpt, qwen_fitted, qwen3_5_mtp, jobs, plain, lambda drafted: drafted // 2,
                state_slots=runner.max_rows + 1)


def test_qwen3_5_gguf_served_with_mtp_through_the_engine_builder(qwen, qwen_fitted):
    """`--speculative mtp` on the GGUF file from the engine builder (check_mtp accepts it, the
    block read from the file, its K/V in the block budget) behind the real server: the plain
    greedy reply, drafts accepted and counted, no compile after warm-up."""
    _, _, _, _, ckpt, jobs, plain = qwen
    text, stats = serve_one_greedy_completion(qwen_fitted, _spec(1), jobs[0].prompt_token_ids)
    assert text == ckpt.tokenizer.decode(plain.tokens["r0"][0])
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["recompiles_after_warmup"] == 0


def test_qwen3_5_gguf_without_the_block_is_refused(qwen):
    _refused(qwen[2], r"no-mtp\.gguf has no multi-token-prediction layer \(no blk\.4\.nextn\.eh_proj\.weight; "
                      r"qwen35\.nextn_predict_layers is 0")


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_moe_gguf_mtp_layer_with_experts_equals_the_safetensors_one(arch, tmp_path, monkeypatch):
    """Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`): the block's decoder layer has the
    model's experts (stacked into `ffn_*_exps` by the converter) and shared expert
    (`ffn_*_shexp`, its gate `ffn_gate_inp_shexp`); its `mtp.layers.0.*` are fresh values of
    the shapes of the main model's full-attention layer 1."""
    from safetensors.numpy import load_file

    from models import qwen3_5_mtp

    shapes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if arch == "qwen3next":
        config = transformers.Qwen3NextConfig(**shapes, intermediate_size=128)
        config.architectures = ["Qwen3NextForCausalLM"]
    else:
        config = transformers.Qwen3_5MoeTextConfig(**shapes)
        config.architectures = ["Qwen3_5MoeForCausalLM"]
    folder = fc.make_checkpoint(tmp_path / f"tiny-{arch}", config)
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.RandomState(2)
    d = config.hidden_size
    mtp = {"mtp.fc.weight": rng.randn(d, 2 * d) / np.sqrt(2 * d),
           **{f"mtp.{k}.weight": 0.3 * rng.randn(d) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
           **layer_tensors(tensors, 1, rng, scale_out=1.0)}
    assert any(".mlp.experts.3." in k for k in mtp) and "mtp.layers.0.mlp.shared_expert_gate.weight" in mtp
    _save(folder, mtp)
    path = write_qwen35_gguf(folder, tmp_path / f"tiny-{arch}.gguf", arch=arch)
    _check_parity(qwen3_5_mtp, folder, path, monkeypatch, arch, control=False)  # the controls: Qwen3.5's


# -- DeepSeek-V3 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(root, folder without the layer, its GGUF, runner over the GGUF's model, checkpoint, jobs, plain run)."""
    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint

    root = tmp_path_factory.mktemp("gguf_mtp_deepseek")
    folder = fc.make_checkpoint(root / "tiny-deepseek-v3", transformers.DeepseekV3Config(**DEEPSEEK))
    bare = write_deepseek2_gguf(folder, root / "no-mtp.gguf")  # as DeepseekV2Model writes it: no MTP layer
    ckpt = load_checkpoint(str(bare))
    ckpt.model.keeps_step_hidden = True
    runner = ModelRunner(ckpt.model, num_blocks=64, block_size=4, max_rows=_spec().step_rows(MAX_ROWS),
                         max_chunk_tokens=32, max_context=128)
    rng = np.random.RandomState(0)
    jobs = [Job(request_id=f"r{i}", prompt_token_ids=tuple(rng.randint(0, 380, n).tolist()), max_tokens=24,
                sampling=GREEDY) for i, n in enumerate((9, 14))]
    plain = drive(runner, ckpt.tokenizer, jobs, None, max_rows=MAX_ROWS)
    return root, folder, bare, runner, ckpt, jobs, plain


def _deepseek_mtp(tensors, n: int, rng, eh_proj, head, norms, scale_out: float) -> dict[str, np.ndarray]:
    d = eh_proj.shape[0]
    return {f"model.layers.{n}.{k}": v for k, v in {
        "enorm.weight": norms[0], "hnorm.weight": norms[1], "eh_proj.weight": eh_proj,
        "shared_head.norm.weight": np.ones(d), "shared_head.head.weight": head,
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        **layer_tensors(tensors, n - 1, rng, scale_out, prefix="")}.items()}


def test_deepseek_v3_gguf_mtp_layer_equals_the_safetensors_one(deepseek, monkeypatch):
    from safetensors.numpy import load_file

    from models import deepseek_mtp

    root, folder, *_ = deepseek
    random = shutil.copytree(folder, root / "random-mtp")
    tensors = load_file(str(random / "model.safetensors"))
    rng = np.random.RandomState(1)
    v, d = tensors["lm_head.weight"].shape
    _save(random, _deepseek_mtp(tensors, 2, rng, rng.randn(d, 2 * d) / np.sqrt(2 * d), 0.1 * rng.randn(v, d),
                                (1 + 0.3 * rng.randn(d), 1 + 0.3 * rng.randn(d)), scale_out=1.0))
    path = write_deepseek2_gguf(random, root / "random-mtp.gguf", mtp=True)
    _check_parity(deepseek_mtp, random, path, monkeypatch, "DeepSeek-V3")


def test_deepseek_v3_greedy_with_gguf_drafts_equals_greedy_without(deepseek):
    from safetensors.numpy import load_file

    from models import deepseek_mtp

    root, folder, _, runner, ckpt, jobs, plain = deepseek
    fitted = shutil.copytree(folder, root / "fitted-mtp")
    succ: dict[int, int] = {}
    for rows in plain.tokens.values():
        for x, y in zip(rows[0][4:], rows[0][5:]):
            succ.setdefault(x, y)
    tensors = load_file(str(fitted / "model.safetensors"))
    v, d = tensors["lm_head.weight"].shape
    pre = {y: x for x, y in reversed(list(succ.items()))}  # head column y <- lm_head column pre[y]
    rest = iter(sorted(set(range(v)) - set(pre.values())))
    columns = [pre[y] if y in pre else next(rest) for y in range(v)]
    eh_proj = np.concatenate([np.zeros((d, d)), np.eye(d)], axis=1)  # reads the hidden state only
    _save(fitted, _deepseek_mtp(tensors, 2, np.random.RandomState(2), eh_proj, tensors["lm_head.weight"][columns],
                                (np.ones(d), np.ones(d)), scale_out=0.02))
    path = write_deepseek2_gguf(fitted, root / "fitted-mtp.gguf", mtp=True)
    # its second draft reuses the layer on its own output and is mostly wrong (tests/models/test_mtp.py)
    _fitted_run(runner, ckpt, path, deepseek_mtp, jobs, plain, lambda drafted: drafted // (3 * K) + 1)


def test_deepseek_v3_gguf_without_the_layer_is_refused(deepseek):
    _refused(deepseek[2], r"no-mtp\.gguf has no multi-token-prediction layer \(no blk\.2\.nextn\.eh_proj\.weight")
