"""Qwen3.5 from a GGUF file: llama.cpp's `qwen35` architecture read into `Qwen3_5Config`'s
fields, its tensor names, and the layouts its converter changed, undone.

llama.cpp's converter (`conversion/qwen.py:Qwen3_5TextModel` over Qwen3NextModel and
`_LinearAttentionVReorderBase`, read back by `src/models/qwen35.cpp`) writes these keys
(`qwen35.` prefix) and tensors:

    layers              block_count - nextn_predict_layers (the multi-token-prediction
                        layers it appends, `blk.{n}` on, are dropped at load)
    layer kinds         attention.recurrent_layers (per block: true for DeltaNet), else
                        full_attention_interval (every n-th layer full attention; 4)
    DeltaNet shapes     ssm.group_count = k heads, ssm.time_step_rank = v heads,
                        ssm.state_size = k head size, ssm.inner_size = v heads * v head size,
                        ssm.conv_kernel
    partial RoPE        rope.dimension_count = head_dim * partial_rotary_factor
    M-RoPE sections     rope.dimension_sections: a text sequence has one position on every
                        section, where M-RoPE is plain RoPE: read and not needed

    DeltaNet tensors    attn_qkv (in_proj_qkv), attn_gate (in_proj_z), ssm_beta (in_proj_b),
                        ssm_alpha (in_proj_a), ssm_conv1d [C, Kc] (conv1d squeezed),
                        ssm_a = -exp(A_log), ssm_dt.bias (dt_bias), ssm_norm, ssm_out

What the converter changed, and we undo (`merge_tensors`):
- every norm weight but DeltaNet's gated norm is stored as 1 + w (ggml multiplies by the
  weight; Qwen3.5 applies 1 + w): 1 is subtracted;
- A_log is stored as -exp(A_log): we take log(-a);
- with fewer k heads than v heads the value heads are reordered from grouped by k head
  ([k0: v0 v1, k1: v0 v1]) to tiled ([v0: k0 k1, v1: k0 k1]), for ggml's broadcast: in the v
  rows of attn_qkv and of the conv, attn_gate's rows, ssm_beta / ssm_alpha's rows, ssm_a,
  ssm_dt and ssm_out's columns; we put them back.
The DeltaNet tensors are read as float even from a quantized file (the quantized serving
modes take only the tensors whose names map straight to ours; these need the reorder first).
The full-attention layers' q_proj (query and gate rows per head) is written as HF's.

Qwen3-Next (`qwen3next`, `conversion/qwen.py:Qwen3NextModel`; read by models/qwen3_next.py with
these keys) is written the same way except that its value heads are not reordered and its fused
`in_proj_qkvz` is split into `attn_qkv` (q, k, v of every k head) and `attn_gate` (z), joined
back here; `in_proj_ba` is kept whole as `ssm_ba`.

A GGUF LoRA adapter for these files (llama.cpp's convert_lora_to_gguf.py runs the same edits on
each (lora_a, lora_b) pair) has its DeltaNet tensors put back by the same rules (`merge_adapter`,
through `models/lora_gguf.py`): the value heads of B's rows (attn_qkv's v rows, attn_gate,
ssm_beta, ssm_alpha) and of ssm_out's A columns regrouped; for Qwen3-Next attn_qkv and
attn_gate joined back into in_proj_qkvz's rows under their shared lora_a.

Refused at load, by key: a DeltaNet layer kind mask that is not booleans per block, v heads
not a multiple of k heads (`ssm.time_step_rank`), an inner size not a multiple of the v heads.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from models.config import UnsupportedModelError
from models.lora import LoraError

ARCH = "qwen35"

# GGUF suffix after blk.{i}. -> ours: the tensors read as they are (norms shifted in merge_tensors)
GGUF_LAYER_WEIGHTS = {
    "attn_norm.weight": "input_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "ssm_norm.weight": "gate_norm",
}
_STORED_PLUS_ONE = ("input_norm", "post_attn_norm", "q_norm", "k_norm")  # and final_norm


def _per_block(meta, key: str, blocks: int) -> list[bool]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != blocks:
        raise UnsupportedModelError(f"GGUF {key} must hold one boolean per block ({blocks}); got {value!r}")
    return [bool(v) for v in value]


def config_fields(meta, fields: dict) -> dict[str, Any]:
    """`Qwen3_5Config` keyword arguments (Qwen3-Next's too) from the metadata and the loader's
    shared fields (module docstring: the keys)."""
    a = meta.arch
    blocks = int(fields["num_layers"])
    n = blocks - int(meta.get(f"{a}.nextn_predict_layers", 0) or 0)
    if n <= 0:
        raise UnsupportedModelError(f"GGUF {a} holds only multi-token-prediction layers; serve the main model's file")
    if meta.get(f"{a}.attention.recurrent_layers") is not None:
        linear = _per_block(meta, f"{a}.attention.recurrent_layers", blocks)[:n]
    else:
        interval = int(meta.get(f"{a}.full_attention_interval", 4) or 4)
        linear = [(i + 1) % interval != 0 for i in range(n)]
    k_heads = int(meta.require(f"{a}.ssm.group_count"))
    v_heads = int(meta.require(f"{a}.ssm.time_step_rank"))
    inner = int(meta.require(f"{a}.ssm.inner_size"))
    if v_heads % k_heads:
        raise UnsupportedModelError(f"GGUF {a}.ssm.time_step_rank {v_heads} (v heads) is not a multiple of "
                                    f"{a}.ssm.group_count {k_heads} (k heads); not supported")
    if inner % v_heads:
        raise UnsupportedModelError(f"GGUF {a}.ssm.inner_size {inner} is not a multiple of the {v_heads} v heads")
    return dict(fields, num_layers=n, linear_layers=tuple(linear), linear_num_key_heads=k_heads,
                linear_num_value_heads=v_heads, linear_key_head_dim=int(meta.require(f"{a}.ssm.state_size")),
                linear_value_head_dim=inner // v_heads,
                linear_conv_kernel_dim=int(meta.require(f"{a}.ssm.conv_kernel")))


def grouped_heads(arr: np.ndarray, axis: int, k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """The converter's tiled value-head order ([v_per_k, k_heads, head_dim] along `axis`) back
    to HF's grouped one ([k_heads, v_per_k, head_dim])."""
    arr = np.moveaxis(arr, axis, 0)
    rest = arr.shape[1:]
    out = arr.reshape(v_per_k, k_heads, head_dim, *rest).swapaxes(0, 1).reshape(arr.shape)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def regroup_heads(w: np.ndarray, axis: int, k_heads: int, v_per_k: int, head_dim: int, skip: int = 0) -> np.ndarray:
    """`grouped_heads` on `w` along `axis` past its first `skip` entries (attn_qkv's and the
    conv's q and k channels, which the converter leaves); nothing to undo when v_per_k is 1."""
    if v_per_k == 1:
        return w
    head, tail = np.split(w, [skip], axis=axis) if skip else (None, w)
    tail = grouped_heads(tail, axis, k_heads, v_per_k, head_dim)
    return tail if head is None else np.concatenate([head, tail], axis=axis)


def join_qkvz(qkv: np.ndarray, z: np.ndarray, hk: int, dk: int, group_v: int) -> np.ndarray:
    """Qwen3-Next: rows [q | k | v of every k head] (`attn_qkv`) and [z] (`attn_gate`) back into
    HF's `in_proj_qkvz` rows, which group each k head's q, k, v and z: [out, d] -> [out', d]."""
    d = qkv.shape[-1]
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
    groups = [q.reshape(hk, dk, d), k.reshape(hk, dk, d), v.reshape(hk, group_v, d), z.reshape(hk, group_v, d)]
    return np.concatenate(groups, axis=1).reshape(-1, d)


def _fuse_qkvz(tensors: dict, hk: int, dk: int, group_v: int) -> None:
    """Qwen3-Next: the converter's `attn_qkv` and `attn_gate` back into `in_proj_qkvz` (`join_qkvz`;
    ours: transposed)."""
    for name in [n for n in tensors if n.startswith("gguf:blk.") and n.endswith(".attn_qkv.weight")]:
        gate = name.replace(".attn_qkv.", ".attn_gate.")
        if gate not in tensors:
            continue  # reported as unexpected by the build, with its name

        def read(qkv_load=tensors.pop(name), z_load=tensors.pop(gate)):
            qkv, z = np.asarray(qkv_load(), np.float32), np.asarray(z_load(), np.float32)
            return np.ascontiguousarray(join_qkvz(qkv, z, hk, dk, group_v).T)

        tensors[f"layers.{name.split('.')[1]}.in_proj_qkvz"] = read


def merge_tensors(tensors: dict, cfg) -> None:
    """In place: the DeltaNet tensors (passed through as "gguf:blk.{i}.<name>", in the reader's
    [out, in] order) to ours with the value heads regrouped, norms less 1, A_log from -exp(A_log),
    and the multi-token-prediction layers dropped (module docstring)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = hv // hk

    def regroup(axis: int, head_dim: int, skip: int = 0) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: regroup_heads(w, axis, hk, r, head_dim, skip)

    qk = 2 * hk * dk
    if cfg.fused_deltanet:  # qwen3next: no value-head reorder; q/k/v and z split from in_proj_qkvz
        r = 1
        _fuse_qkvz(tensors, hk, dk, hv // hk * dv)
    rules: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {  # GGUF suffix -> (ours, fix)
        "attn_qkv.weight": ("in_proj_qkv", lambda w: regroup(0, dv, qk)(w).T),
        "attn_gate.weight": ("in_proj_z", lambda w: regroup(0, dv)(w).T),
        "ssm_beta.weight": ("in_proj_b", lambda w: regroup(0, 1)(w).T),
        "ssm_alpha.weight": ("in_proj_a", lambda w: regroup(0, 1)(w).T),
        "ssm_conv1d.weight": ("conv_weight", lambda w: regroup(0, dv, qk)(w.reshape(w.shape[0], -1))[:, None, :]),
        "ssm_a": ("A_log", lambda w: np.log(-regroup(0, 1)(w.reshape(-1)))),
        "ssm_dt.bias": ("dt_bias", lambda w: regroup(0, 1)(w.reshape(-1))),
        "ssm_out.weight": ("out_proj", lambda w: regroup(1, dv)(w).T),
    }
    for name in list(tensors):
        parts = name.split(".")
        if name.startswith(("gguf:blk.", "layers.")) and int(parts[1]) >= cfg.num_layers:
            del tensors[name]  # a multi-token-prediction layer
            continue
        suffix = ".".join(parts[2:])
        if name.startswith("gguf:blk.") and suffix in rules:
            ours, fix = rules[suffix]
            load = tensors.pop(name)
            tensors[f"layers.{parts[1]}.{ours}"] = lambda load=load, fix=fix: np.ascontiguousarray(
                fix(np.asarray(load(), np.float32)))
        elif name == "final_norm" or (name.startswith("layers.") and parts[-1] in _STORED_PLUS_ONE):
            load = tensors[name]
            tensors[name] = lambda load=load: np.asarray(load(), np.float32) - np.float32(1.0)


# A LoRA adapter's DeltaNet tensors: GGUF suffix -> (ours, the factor the converter reordered, its
# axis, the head size, the entries left in place ahead of the value heads). lora_a is [r, in] and
# lora_b [out, r]: a reorder of the base weight's rows moves B's rows, one of its columns A's.
_ADAPTER_RULES = {
    "attn_qkv.weight": ("in_proj_qkv", "B", 0, "dv", "qk"),
    "attn_gate.weight": ("in_proj_z", "B", 0, "dv", None),
    "ssm_beta.weight": ("in_proj_b", "B", 0, None, None),
    "ssm_alpha.weight": ("in_proj_a", "B", 0, None, None),
    "ssm_out.weight": ("out_proj", "A", 1, "dv", None),
}


def merge_adapter(pairs: dict, cfg) -> dict:
    """A GGUF LoRA adapter's DeltaNet tensors back to ours (`models/lora_gguf.py`).

    llama.cpp's convert_lora_to_gguf.py runs this file's base-model edits on each (lora_a, lora_b)
    pair, so its value heads are tiled as the base weights' are (module docstring): in B's rows for
    attn_qkv (the v rows), attn_gate, ssm_beta and ssm_alpha, in A's columns for ssm_out. They are
    put back by the same rule (`regroup_heads`). Qwen3-Next: no reorder; an adapter's attn_qkv and
    attn_gate (llama.cpp's converter stops on a fused in_proj_qkvz adapter, but their split of the
    output rows keeps one A) are joined back into in_proj_qkvz's rows (`join_qkvz`); its ssm_ba
    goes through the name table as it is.

    Args:
      pairs: {(layer, GGUF suffix): {"A": f32[r, in], "B": f32[out, r]}} as read; the DeltaNet
        entries are taken out of it (the rest map through the family's name table).
    Returns: {(layer, ours): {"A", "B"}} in the checkpoint's (HF's) layout.
    Raises: LoraError("invalid_adapter") for half a fused pair or two different A's.
    """
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = 1 if cfg.fused_deltanet else hv // hk
    sizes = {"dv": dv, "qk": 2 * hk * dk, None: 0}
    out = {}
    for (layer, suffix) in [key for key in pairs if key[1] in _ADAPTER_RULES]:
        ab = pairs.pop((layer, suffix))
        ours, factor, axis, head, skip = _ADAPTER_RULES[suffix]
        if factor in ab:
            ab = {**ab, factor: regroup_heads(ab[factor], axis, hk, r, sizes[head] or 1, sizes[skip])}
        out[(layer, ours)] = ab
    if cfg.fused_deltanet:
        for layer in sorted({layer for layer, name in out if name in ("in_proj_qkv", "in_proj_z")}):
            qkv, z = out.pop((layer, "in_proj_qkv"), None), out.pop((layer, "in_proj_z"), None)
            if qkv is None or z is None or set(qkv) != {"A", "B"} or set(z) != {"A", "B"}:
                raise LoraError("invalid_adapter", f"layer {layer}: Qwen3-Next's in_proj_qkvz adapter needs both "
                                                   "attn_qkv and attn_gate, each with lora_a and lora_b")
            if qkv["A"].shape != z["A"].shape or not np.array_equal(qkv["A"], z["A"]):
                raise LoraError("invalid_adapter", f"layer {layer}: attn_qkv and attn_gate hold different lora_a; "
                                                   "as parts of one in_proj_qkvz adapter they must share it")
            out[(layer, "in_proj_qkvz")] = {"A": qkv["A"], "B": join_qkvz(qkv["B"], z["B"], hk, dk, hv // hk * dv)}
    return out
