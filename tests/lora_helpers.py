"""Tiny random PEFT LoRA adapters for tests, and a runner with adapter slots."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base: Path, out: Path, seed: int, r: int = 4, alpha: float = 8.0,
                      targets=tuple(ALL_TARGETS), use_rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter for the HF checkpoint `base` under `out`, with random A and
    non-zero B (`init_lora_weights=False`: PEFT's default B is zeros, an adapter that
    changes nothing and would make every parity check pass trivially)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf, config)
    model.save_pretrained(out)
    return out


def peft_models(base: Path, adapter: Path):
    """(unmerged PeftModel, merged plain model) for `adapter` on `base`, float32, eval."""
    import peft
    import torch
    import transformers

    def fresh():
        return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    unmerged = peft.PeftModel.from_pretrained(fresh(), adapter).eval()
    merged = peft.PeftModel.from_pretrained(fresh(), adapter).merge_and_unload().eval()
    return unmerged, merged


def lora_runner(path, max_loras: int = 2, max_rank: int = 8, **runner_kwargs):
    """(runner, registry, checkpoint) over `path` with `max_loras` adapter slots of rank <= `max_rank`."""
    from ferrox_jax.lora_registry import LoraRegistry
    from ferrox_jax.runner import ModelRunner
    from models.registry import family_for
    from models.loader import load_checkpoint
    from models.lora import LoraSlots, attach_lora

    ckpt = load_checkpoint(str(path))
    slots = LoraSlots(max_loras, max_rank)
    targets = attach_lora(ckpt.model, slots)
    kwargs = dict(num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=16, max_context=128)
    kwargs.update(runner_kwargs)
    runner = ModelRunner(ckpt.model, **kwargs)
    registry = LoraRegistry(runner, slots, family_for(ckpt.config.architecture).hf_layer_weights, targets)
    return runner, registry, ckpt
