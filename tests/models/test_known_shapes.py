"""models/known_shapes.py: config-only folders of public checkpoints' shapes, shared by the
dummy-loader tests, the device check and the sizing CLI; standard library only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.known_shapes import SHAPES, write_config_folder

REPO = Path(__file__).resolve().parents[2]


def test_a_written_folder_holds_exactly_the_shapes_config(tmp_path):
    folder = write_config_folder("tiny", tmp_path / "nested" / "tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"], "config only: no weights, no tokenizer"
    assert json.loads((folder / "config.json").read_text()) == SHAPES["tiny"]


def test_an_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        write_config_folder("llama-9", tmp_path / "x")


def test_importing_the_shapes_loads_nothing_beyond_the_standard_library():
    code = ("import sys; before = set(sys.modules); import models.known_shapes; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.split('.')[0] not in sys.stdlib_module_names and m.split('.')[0] != 'models'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"models.known_shapes pulled in {out.stdout.strip()}"


def test_the_large_moe_shapes_parse_with_their_cache_geometry():
    """DeepSeek-V3 and Kimi K2 cache one latent head (512 + 64) per token and layer, 71x
    (DeepSeek-V3) and 36x (Kimi K2) less than their expanded heads; GLM-4.5 caches plain GQA
    heads with half of each rotated."""
    from models.registry import config_from_hf

    ds, kimi, glm = (config_from_hf(SHAPES[name]) for name in ("deepseek-v3", "kimi-k2", "glm-4.5"))
    for cfg, heads in ((ds, 128), (kimi, 64)):
        assert cfg.kv_cache_dims() == (1, 576, 0)
        assert cfg.kv_bytes_per_token(2) == 61 * 576 * 2
        full = 61 * heads * (128 + 64 + 128) * 2  # k (nope + rope) and v per head, bfloat16
        assert round(full / cfg.kv_bytes_per_token(2)) == {128: 71, 64: 36}[heads]
    assert ds.yarn.factor == 40 and ds.dense_layers == (0, 1, 2) and (ds.n_group, ds.topk_group) == (8, 4)
    assert kimi.num_experts == 384 and kimi.dense_layers == (0,)
    assert glm.kv_cache_dims() == (8, 128, 128) and glm.rotary_dim == 64 and glm.qk_norm and glm.attention_bias
