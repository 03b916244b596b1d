"""Gemma 2 against HF transformers: (1 + w) norms before and after attention and MLP,
embeddings times sqrt(hidden), GeGLU (tanh GELU), query_pre_attn_scalar, attention and
final logit soft-capping, a sliding window on alternate layers; its chat template's
refusal of a system message as a 400; served by the real `ferrox serve` console script;
and the same weights through the GGUF loader.

The tiny config makes every difference count: the window (12 keys) is shorter than the
48-token prompt, the caps (attention 3, final 4) are within the logits' range so tanh
bends them, and query_pre_attn_scalar (24) is not head_dim (16).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from tests.support import family_checks as fc
from tests.support.server_harness import free_port, wait_for_serve_process

# Gemma's own template shape: a system turn is refused with raise_exception.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SYSTEM_FIRST = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=12,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("gemma2") / "tiny-gemma2", config,
                              chat_template=GEMMA_TEMPLATE)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_config_alternates_sliding_and_full_layers(gemma2):
    cfg = gemma2[2].config
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 12
    assert (cfg.window(0), cfg.window(1)) == (12, None)
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (24.0, 3.0, 4.0)
    assert cfg.tie_word_embeddings


def test_matches_transformers(gemma2):
    fc.assert_report(gemma2[2], "gemma2")


def test_logits_are_soft_capped(gemma2):
    """Final soft-capping bounds every logit by the cap: |logit| < 4."""
    path, hf, report = gemma2
    logits = fc.hf_logits(hf, report.prompt)
    assert abs(logits).max() < 4.0 and abs(logits).max() > 2.0, "the cap should bend these logits"


def test_gguf_loads_the_same_model(gemma2, tmp_path):
    path, hf, report = gemma2
    got = fc.check_gguf(path, tmp_path / "tiny-gemma2.gguf", "gemma2", hf, report.prompt)
    assert got["err"] < fc.ATOL, f"gemma2 GGUF prompt logits differ from HF by {got['err']:.3g}"
    assert got["same_tokens"]
    cfg, ref = got["config"], got["reference_config"]
    assert (cfg.layer_types, cfg.sliding_window, cfg.attn_logit_softcap, cfg.final_logit_softcap) == \
        (ref.layer_types, ref.sliding_window, ref.attn_logit_softcap, ref.final_logit_softcap)


def test_served_end_to_end_and_system_role_is_a_400(gemma2):
    path, hf, _ = gemma2
    served = fc.serve(path, messages=[{"role": "user", "content": "Hello world!"}])
    fc.assert_served(served, hf, "Gemma2ForCausalLM")
    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    with ServerThread(create_app(tiny_engine(path, **fc.SERVE_LIMITS))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-gemma2", messages=SYSTEM_FIRST, max_tokens=4)
    assert e.value.status_code == 400
    assert "System role not supported" in e.value.body["message"]
    assert e.value.body["param"] == "messages"


@contextlib.contextmanager
def ferrox_serve(model_dir: Path, log_path: Path):
    """The real `ferrox serve` console script on a free loopback port."""
    port = free_port()
    script = Path(sys.executable).with_name("ferrox")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]
    limits = fc.SERVE_LIMITS
    cmd += ["serve", "--model", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--kv-blocks", str(limits["kv_blocks"]), "--block-size", str(limits["block_size"]),
            "--max-seqs", str(limits["max_seqs"]), "--prefill-chunk", str(limits["prefill_chunk"]),
            "--max-context", str(limits["max_context"]), "--max-queue", str(limits["max_queue"]),
            "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_serve_process(proc, url, log_path, 180, interval_s=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_ferrox_serve_console_script_serves_gemma2(gemma2, tmp_path):
    path, hf, _ = gemma2
    with ferrox_serve(path, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        card = client.models.list().data[0]
        chat = client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        refused = httpx.post(url + "/v1/chat/completions", timeout=30,
                             json={"model": card.id, "messages": SYSTEM_FIRST, "max_tokens": 4})
    assert card.model_extra["architecture"] == "Gemma2ForCausalLM"
    assert chat.usage.completion_tokens == 5
    assert refused.status_code == 400, refused.text
    assert "System role not supported" in refused.json()["error"]["message"]


@pytest.mark.parametrize("layers,scalar", [(46, 4608 / 32), (26, 128.0)])
def test_gguf_without_attention_scale_follows_llama_cpp(tmp_path, layers, scalar):
    """No query_pre_attn_scalar in GGUF: hidden / heads for the 27B (46 layers, 4608 / 32 =
    144), head_dim (128 here) otherwise, as llama.cpp decides."""
    import gguf

    from models.loaders.gguf import config_from_gguf, open_gguf

    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(layers)
    w.add_embedding_length(4608)
    w.add_feed_forward_length(36864)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = config_from_gguf(open_gguf(path))
    assert cfg.query_pre_attn_scalar == scalar
    assert cfg.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
