"""One greedy completion through the real server with `--speculative mtp`, and the server's
counters after it: the served check the MTP tests share (tests/models/test_mtp_qwen3_5.py for
a safetensors folder, tests/models/test_gguf_mtp.py for a GGUF file's nextn block)."""

from __future__ import annotations

from tests.support import family_checks as fc


def serve_one_greedy_completion(path, speculative, prompt_ids, max_tokens: int = 14) -> tuple[str, dict]:
    """(completion text, /admin/stats once the drafts are counted) for `prompt_ids` on a one-row
    engine of `path` built by the engine builder with `speculative`, behind a real server."""
    import httpx

    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine, wait_for

    engine = tiny_engine(path, speculative=speculative, **{**fc.SERVE_LIMITS, "max_seqs": 1, "prefill_chunk": 8})
    with ServerThread(create_app(engine)) as base, httpx.Client(base_url=base, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stats = wait_for(lambda: (s := http.get("/admin/stats").json())["spec_decode_num_draft_tokens"] and s)
    print({k: v for k, v in stats.items() if k.startswith("spec_decode")})
    return text, stats
