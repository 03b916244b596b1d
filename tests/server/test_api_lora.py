"""LoRA adapters through a real server and the official clients.

One engine (tiny Llama, 3 adapter slots of rank <= 8, adapter `a1` loaded at start-up
with --lora-modules, and `a1g`, the same adapter as llama.cpp's GGUF LoRA file) behind an API key, runtime loading on, `--model-dir` holding the
base checkpoint and the adapters. Greedy outputs are checked against HF peft's greedy
tokens for the same prompt ids; the runner's recompile counter must stay 0 through
loading, mixing, unloading and reloading.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.lora_helpers import make_peft_adapter, peft_models, peft_to_gguf
from tests.support.server_harness import ServerThread

KEY = "lora-test-key"
PROMPT = [5, 17, 42, 99, 7, 64, 3, 120, 11, 250, 33, 8]  # token ids (the tiny vocab has 384)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tests.support.faults import FaultyRunner
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-models")
    base = make_tiny_checkpoint(root / "tiny-base", max_position_embeddings=256)
    paths = {"a1": make_peft_adapter(base, root / "a1", seed=1, r=4),
             "a2": make_peft_adapter(base, root / "a2", seed=2, r=8, targets=("q_proj", "v_proj", "up_proj")),
             "big": make_peft_adapter(base, root / "big", seed=3, r=16),
             "head": make_peft_adapter(base, root / "head", seed=4, r=4, targets=("lm_head",))}
    hf = json.loads((base / "config.json").read_text())
    paths["a1.gguf"] = peft_to_gguf(paths["a1"], root / "a1.gguf", "llama", hf["num_attention_heads"],
                                    hf["num_key_value_heads"])
    engine = Engine.load(EngineConfig(model=str(base), dtype="float32", block_size=16, kv_blocks=64, max_seqs=4,
                                      max_queue=8, prefill_chunk=32, max_context=256, max_loras=3,
                                      max_lora_rank=8, lora_modules=(("a1", str(paths["a1"])),
                                                                     ("a1g", str(paths["a1.gguf"])))),
                         wrap_runner=FaultyRunner)  # inert until a test cues a fault
    engine.warmup()
    engine.start()
    app = create_app(engine, ServerConfig(api_key=KEY, model_dir=str(root), enable_runtime_lora=True,
                                         response_cache=True))
    with ServerThread(app) as url:
        yield url, engine, base, paths
    engine.shutdown()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _post(client, route, body):
    return client.post(route, body=body, cast_to=httpx.Response)


def _complete(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    return out.choices[0].text


def _peft_text(base, adapter, tokenizer):
    import torch

    model = peft_models(base, adapter)[0]
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(PROMPT):]
    return tokenizer.decode(ids.tolist())


def test_the_response_cache_keeps_adapters_apart(server):
    url = server[0]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        answers = []
        for model in (server[1].model_name, "a1", "a1"):
            r = http.post("/v1/completions", json={**body, "prompt": PROMPT[::-1], "model": model})
            assert r.status_code == 200, r.text
            answers.append((r.headers["ferrox-cache"], r.json()["choices"][0]["text"]))
    assert [status for status, _ in answers] == ["miss", "miss", "hit"], "the adapter is in the cache's key"
    assert answers[2][1] == answers[1][1] != answers[0][1]


def test_models_list_adapters_with_parent(server):
    url, engine, _, _ = server
    cards = {m.id: m for m in _client(url).models.list().data}
    assert set(cards) == {engine.model_name, "a1", "a1g"}
    assert cards["a1"].parent == engine.model_name, "an adapter's card names the base model as parent"


def test_load_use_unload_reload_with_zero_recompiles(server):
    url, engine, base, paths = server
    client = _client(url)
    tok = engine.tokenizer
    assert _complete(client, "a1") == _peft_text(base, paths["a1"], tok), "a1 greedy text differs from peft's"
    base_text = _complete(client, engine.model_name)
    assert _complete(client, "a1") != base_text, "the adapter must change the output"

    reply = _post(client, "/load_lora_adapter", {"lora_name": "a2", "lora_path": "a2"})
    assert reply.status_code == 200 and "a2" in reply.text
    a2_text = _complete(client, "a2")
    assert a2_text == _peft_text(base, paths["a2"], tok), "a2 (loaded at run time) differs from peft"

    # Mixed: the base model and both adapters at once, each as alone.
    models = [engine.model_name, "a1", "a2"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: _complete(client, m), models))
    alone = {engine.model_name: base_text, "a1": _complete(client, "a1"), "a2": a2_text}
    assert texts == [alone[m] for m in models], "a row in a mixed batch differs from the same request alone"

    assert _post(client, "/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        _complete(client, "a2")
    assert gone.value.body["code"] == "model_not_found"
    assert "a2" not in {m.id for m in client.models.list().data}
    assert _post(client, "/load_lora_adapter", {"lora_name": "a2", "lora_path": str(paths["a2"])}).status_code == 200
    assert _complete(client, "a2") == a2_text, "a reloaded adapter answers as before"

    # The GGUF form of a1: from --lora-modules, then unloaded and loaded again by the route.
    a1_text = _complete(client, "a1")
    assert _complete(client, "a1g") == a1_text, "a1's GGUF LoRA file (--lora-modules) answers as a1"
    assert _post(client, "/unload_lora_adapter", {"lora_name": "a1g"}).status_code == 200
    assert _post(client, "/load_lora_adapter", {"lora_name": "a1g", "lora_path": "a1.gguf"}).status_code == 200
    assert _complete(client, "a1g") == a1_text, "a1's GGUF LoRA file (loaded at run time) answers as a1"
    assert engine.runner.recompiles_after_warmup == 0, "loading, mixing and unloading must not compile"


def test_refusals_by_name(server):
    url, engine, _, paths = server
    client = _client(url)

    def refused(body, route="/load_lora_adapter"):
        with pytest.raises(openai.APIStatusError) as e:
            _post(client, route, body)
        return e.value.status_code, e.value.body["code"]

    assert refused({"lora_name": "big", "lora_path": "big"}) == (400, "rank_too_large")
    assert refused({"lora_name": "head", "lora_path": "head"}) == (400, "missing_target_module")
    assert refused({"lora_name": "x", "lora_path": "../outside"}) == (403, "lora_path_outside_model_dir")
    assert refused({"lora_name": "x", "lora_path": "/etc"}) == (403, "lora_path_outside_model_dir")
    assert refused({"lora_name": "a1", "lora_path": "a1"}) == (400, "adapter_exists")
    assert refused({"lora_name": "nope"}, "/unload_lora_adapter") == (404, "adapter_not_found")
    names = {m.id for m in client.models.list().data}
    if "a2" not in names:
        _post(client, "/load_lora_adapter", {"lora_name": "a2", "lora_path": "a2"})
    assert refused({"lora_name": "a3", "lora_path": "a1"}) == (409, "slots_full")
    unauthenticated = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "a1"})
    assert unauthenticated.status_code == 401, "the LoRA routes sit behind the API key"


def test_runtime_loading_off_by_default(server):
    url, engine, _, _ = server
    app = create_app(engine, ServerConfig(api_key=KEY))
    with ServerThread(app) as other:
        with pytest.raises(openai.PermissionDeniedError) as e:
            _post(_client(other), "/load_lora_adapter", {"lora_name": "z", "lora_path": "a1"})
    assert e.value.body["code"] == "runtime_lora_disabled"


def test_every_protocol_selects_the_adapter_by_model(server):
    import anthropic

    url, engine, _, _ = server
    client = _client(url)
    messages = [{"role": "user", "content": "Hello there"}]

    def chat(model):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
        return out.choices[0].message.content

    want, base = chat("a1"), chat(engine.model_name)
    assert want != base
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    msg = claude.messages.create(model="a1", messages=messages, max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0})
    assert msg.content[0].text == want, "Anthropic Messages with model=a1"
    resp = client.responses.create(model="a1", input=messages, max_output_tokens=MAX_TOKENS, temperature=0.0)
    assert resp.output_text == want, "Responses with model=a1"
    llama = httpx.post(url + "/completion", headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": PROMPT, "n_predict": MAX_TOKENS, "temperature": 0.0, "model": "a1"})
    assert llama.json()["content"] == _complete(client, "a1"), "llama.cpp /completion with model=a1"
    emb = {m: client.embeddings.create(model=m, input="Hello there").data[0].embedding
           for m in ("a1", engine.model_name)}
    assert emb["a1"] != emb[engine.model_name], "embeddings with model=a1 come from the adapted model"


def test_prefix_cache_never_shares_blocks_across_adapters(server):
    url, engine, _, _ = server
    client = _client(url)
    prompt = list(range(40, 40 + 48))  # 3 full blocks of 16

    def cached(model):
        # sampled without a seed: the response cache (on in this server) stays out of it
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=1.0)
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    cached(engine.model_name)
    assert cached(engine.model_name) > 0, "the base model's second identical prompt hits the cache"
    assert cached("a1") == 0, "an adapter must not reuse the base model's blocks"
    assert cached("a1") > 0, "an adapter's own second identical prompt hits its own blocks"


def test_metrics_and_stats_count_adapters(server):
    url, engine, _, _ = server
    client = _client(url)
    before = {a["name"]: a["requests"] for a in httpx.get(url + "/admin/stats", headers={
        "Authorization": f"Bearer {KEY}"}).json()["lora_adapters"]}
    _complete(client, "a1")
    stats = httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    after = {a["name"]: a for a in stats["lora_adapters"]}
    assert after["a1"]["requests"] == before["a1"] + 1 and after["a1"]["running"] == 0
    assert stats["max_loras"] == 3
    metrics = httpx.get(url + "/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="3"' in line and 'running_lora_adapters=""' in line, line


# ---------------------------------------------------------------- broken adapters and names


def _http(url):
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _free_a_slot(client):
    """The module's tests may leave a2 in the third slot; these tests need it free."""
    if "a2" in {m.id for m in client.models.list().data}:
        assert _post(client, "/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200


def _copy_adapter(paths, name, **replace):
    """A copy of a1's PEFT folder next to it (inside --model-dir), with files replaced:
    `config`/`weights` bytes, or `tensors` {key: fn(array) -> array} applied to its weights."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = paths["a1"].parent / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(paths["a1"], folder)
    if "config" in replace:
        (folder / "adapter_config.json").write_bytes(replace["config"])
    if "weights" in replace:
        (folder / "adapter_model.safetensors").write_bytes(replace["weights"])
    if "tensors" in replace:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        for key, edit in replace["tensors"].items():
            tensors[key] = edit(tensors[key])
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


A1_Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


def _with(value):
    def edit(tensor):
        tensor = tensor.copy()
        tensor[0, 0] = value
        return tensor
    return edit


def test_an_adapter_with_nan_or_huge_weights_is_refused_at_load_naming_it_and_the_tensor(server):
    url, _, _, paths = server
    client = _client(url)
    for name, value in (("nanw", float("nan")), ("hugew", 1e30)):
        _copy_adapter(paths, name, tensors={A1_Q_A: _with(value)})
        with pytest.raises(openai.BadRequestError) as e:
            _post(client, "/load_lora_adapter", {"lora_name": name, "lora_path": name})
        message = e.value.body["message"]
        assert e.value.body["code"] == "invalid_adapter", message
        assert f"'{name}'" in message and A1_Q_A in message, f"the refusal names the adapter and the tensor: {message}"
        assert name not in {m.id for m in client.models.list().data}, "a refused adapter is not registered"


def test_a_lone_surrogate_or_control_character_name_is_refused_and_nothing_breaks(server):
    url, engine, _, _ = server
    _free_a_slot(_client(url))
    with _http(url) as http:
        for raw in ('"\\ud800"', '"a\\u0000b"', '"a/b"', json.dumps("x" * 200), json.dumps(engine.model_name)):
            body = ('{"lora_name": %s, "lora_path": "a1"}' % raw).encode()
            reply = http.post("/v1/load_lora_adapter", content=body, headers={"Content-Type": "application/json"})
            assert reply.status_code == 400, f"name {raw}: {reply.status_code} {reply.text}"
            assert reply.json()["error"]["code"] == "invalid_lora_name", reply.text
            assert reply.json()["error"]["param"] == "lora_name", reply.text
        assert http.get("/v1/models").status_code == 200, "/v1/models still answers"
        stats = http.get("/admin/stats")
        assert stats.status_code == 200, "/admin/stats still answers"
        assert {a["name"] for a in stats.json()["lora_adapters"]} <= {"a1", "a1g", "a2"}, "no refused name registered"


MALFORMED_FILES = {
    "not JSON": (dict(config=b"{oops"), "adapter_config.json"),
    "a JSON list": (dict(config=b"[]"), "adapter_config.json"),
    "not UTF-8": (dict(config=b'{"r": 4, "lora_alpha": 8, "note": "\xff"}'), "adapter_config.json"),
    "r 0": (dict(config=b'{"peft_type": "LORA", "r": 0, "lora_alpha": 8}'), "adapter_config.json"),
    "string alpha": (dict(config=b'{"peft_type": "LORA", "r": 4, "lora_alpha": "8x"}'), "adapter_config.json"),
    "garbage safetensors": (dict(weights=b"\x00" * 7 + b"garbage"), "adapter_model.safetensors"),
    "huge header": (dict(weights=(2 ** 40).to_bytes(8, "little") + b"{}"), "adapter_model.safetensors"),
}


@pytest.mark.parametrize("case", list(MALFORMED_FILES))
def test_a_malformed_adapter_under_model_dir_is_a_400_naming_the_file(server, case):
    url, _, _, paths = server
    replace, file_name = MALFORMED_FILES[case]
    _copy_adapter(paths, "broken", **replace)
    with pytest.raises(openai.BadRequestError) as e:
        _post(_client(url), "/load_lora_adapter", {"lora_name": "broken", "lora_path": "broken"})
    assert e.value.body["code"] == "invalid_adapter", f"{case}: {e.value.body}"
    assert f"broken/{file_name}" in e.value.body["message"], f"{case}: the file is named: {e.value.body['message']}"
    internal = ("SafetensorError", "ValueError", "TypeError", "JSONDecodeError", "UnicodeDecodeError", "OSError")
    assert not any(n in e.value.body["message"] for n in internal), f"no exception names: {e.value.body['message']}"


def test_a_nul_in_lora_path_is_a_400(server):
    url = server[0]
    with pytest.raises(openai.BadRequestError) as e:
        _post(_client(url), "/load_lora_adapter", {"lora_name": "nul", "lora_path": "a1\u0000/x"})
    assert (e.value.body["code"], e.value.body["param"]) == ("invalid_lora_path", "lora_path")


class NanAdapterRows:
    """While on, the logits of every row running with the adapter named `name` are NaN on
    the device (between the forward and the sampler), as an adapter whose finite weights
    blow up the activations would make them."""

    def __init__(self, monkeypatch, engine, name):
        import numpy as np

        self.is_on = True

        def nan_rows(pending):  # the engine's fault-injection runner asks (tests/support/faults.py)
            slots = {a.slot for a in engine.adapters() if a.name == name}
            order = pending.order
            hit = (order >= 0) & np.isin(pending.batch.adapter_slots[np.maximum(order, 0)], list(slots))
            return np.flatnonzero(hit) if self.is_on else ()

        monkeypatch.setattr(engine.runner, "nan_rows", nan_rows)


def test_an_adapter_whose_rows_go_non_finite_is_quarantined_and_the_server_keeps_serving(server, monkeypatch):
    """Five loads of an adapter whose every row goes NaN, each faulting a step of its own:
    the engine gives up after 3 faulted steps in a row (max_step_faults), yet it serves on,
    because an adapter's non-finite rows are the adapter's fault."""
    url, engine, _, paths = server
    client = _client(url)
    _free_a_slot(client)
    nan = NanAdapterRows(monkeypatch, engine, "q")
    base_text, a1_text = _complete(client, engine.model_name), _complete(client, "a1")
    with _http(url) as http:
        faults_before = http.get("/admin/stats").json()["step_faults_nonfinite"]
        for cycle in range(5):
            assert _post(client, "/load_lora_adapter", {"lora_name": "q", "lora_path": "a1"}).status_code == 200
            if cycle == 0:  # in flight when its row faults: a streamed request's error event names it
                body = {"model": "q", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
                text = http.post("/v1/completions", json=body).text
                assert '"adapter_quarantined"' in text and "'q'" in text, text
            else:
                with pytest.raises(openai.ConflictError) as running:
                    _complete(client, "q")
                assert running.value.body["code"] == "adapter_quarantined", running.value.body
            with pytest.raises(openai.ConflictError) as later:
                _complete(client, "q")
            assert later.value.body["code"] == "adapter_quarantined" and "unload" in later.value.body["message"]
            card = http.get("/v1/models/q").json()
            assert "non-finite" in (card.get("quarantined") or ""), f"the listing shows the quarantine: {card}"
            assert _complete(client, engine.model_name) == base_text, "the base model keeps answering"
            assert _complete(client, "a1") == a1_text, "another adapter keeps answering"
            assert _post(client, "/unload_lora_adapter", {"lora_name": "q"}).status_code == 200
        stats = http.get("/admin/stats").json()
        assert engine.health() == "ready" and http.get("/health").status_code == 200, "the server survives"
        assert stats["step_faults_nonfinite"] == faults_before + 5, "each faulted step is still counted"
    nan.is_on = False  # "fixed": loaded again under the same name, it answers
    assert _post(client, "/load_lora_adapter", {"lora_name": "q", "lora_path": "a1"}).status_code == 200
    assert _complete(client, "q") == a1_text, "a fixed adapter loaded again under the name serves"
    assert _post(client, "/unload_lora_adapter", {"lora_name": "q"}).status_code == 200
