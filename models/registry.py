"""Architecture name -> model family: the one place that lists what the engine can serve.

HF checkpoints are matched by `config.json` `architectures[0]`, GGUF files by
`general.architecture` and whether they have experts (llama.cpp writes Mixtral as `llama`). Anything else is refused with `UnsupportedModelError` naming the
architecture and listing the supported ones.
"""

from __future__ import annotations

from typing import Any

from models import (deepseek_v3, gemma2, gemma3, gemma4, glm4_moe, gpt_oss, idefics3, llama, llama4, mixtral, phi3,
                    qwen2_5_vl, qwen3, qwen3_5, qwen3_moe, qwen3_next, qwen3_vl)
from models.config import ModelConfig, UnsupportedModelError
from models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, gemma4.FAMILY,
                                phi3.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY, gpt_oss.FAMILY, deepseek_v3.FAMILY,
                                glm4_moe.FAMILY, idefics3.FAMILY, llama4.FAMILY, gemma4.GGUF_MOE_FAMILY,
                                qwen2_5_vl.FAMILY, qwen3_vl.FAMILY, qwen3_5.FAMILY, qwen3_next.FAMILY,
                                qwen3_next.QWEN3_5_MOE)
_BY_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.architectures}
# (general.architecture, has experts) -> family: a `llama` file with experts is Mixtral.
_BY_GGUF_ARCHITECTURE = {(arch, f.gguf_experts): f for f in FAMILIES for arch in f.gguf_architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
SUPPORTED_GGUF_ARCHITECTURES = tuple(dict.fromkeys(arch for arch, _ in _BY_GGUF_ARCHITECTURE))
# Multimodal wrappers of supported text models: named so the refusal says what is missing.
_VISION_ARCHITECTURES = ("Mistral3ForConditionalGeneration",
                         "Qwen2VLForConditionalGeneration")


def family_for(architecture: str) -> Family:
    """The family of an HF architecture name (as `ModelConfig.architecture` holds it)."""
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        extra = " (a vision-language checkpoint: its vision tower is not supported)" \
            if architecture in _VISION_ARCHITECTURES or architecture.endswith("ForConditionalGeneration") else ""
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported{extra}; supported: "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return family


def family_for_gguf(arch: str, experts: bool = False) -> Family:
    """The family of a GGUF file's `general.architecture`; `experts`: the file has experts
    (`{arch}.expert_count` > 0)."""
    family = _BY_GGUF_ARCHITECTURE.get((arch, experts))
    if family is None:
        kinds = [("with" if moe else "without") + " experts" for a, moe in _BY_GGUF_ARCHITECTURE if a == arch]
        detail = f" {'with' if experts else 'without'} experts (only {', '.join(kinds)})" if kinds else ""
        raise UnsupportedModelError(f"GGUF architecture {arch!r}{detail} is not supported; supported: "
                                    f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return family


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A transformers `config.json` dict -> its family's config, refusing what we can't run."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    return family_for(arch).config_from_hf(cfg)
