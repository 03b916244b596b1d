"""tools/bench/bench_serving.py and tools/bench/plot_bench.py: what the benchmark parses and counts.

The main tests drive a real Hypercorn server over the real engine on a tiny random Llama
(tests/support/server_harness.py) with a handful of requests; the SSE edge cases (comments, a role
chunk, mid-stream errors, a missing [DONE]) go through httpx's MockTransport, where the
chunks are written by hand. Behaviour only: no assertion looks at a timing's value.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine
from tools.bench import bench_prompts, bench_serving, plot_bench
from tools.bench.bench_prompts import BenchRequest
from tools.bench.bench_serving import BenchConfig

# The contract with `vllm bench serve`'s result files, spelled out here rather than read
# from RESULT_METRICS so a renamed metric fails this test.
VLLM_FIELDS = ["duration_s", "completed", "num_failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput", "errors"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]
RUN_FIELDS = ["label", "timestamp", "base_url", "endpoint", "model", "input_len", "output_len",
              "num_requests", "max_concurrency", "request_rate", "warmup_requests", "seed", "ignore_eos",
              "min_tokens", "prompt_tokens_from", "input_lens", "output_lens", "ttfts_ms", "e2els_ms"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Its own checkpoint, so its own engine: 4 rows (no run here has more requests in flight),
    # 32-token chunks: 12 executables to warm up where the harness's 32 rows and 64-token chunks make 32.
    engine = tiny_engine(tiny_llama, max_seqs=4, prefill_chunk=32)
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield url


def bench(server: str, tmp_path, name: str, **overrides) -> dict:
    fields = dict(base_url=server, label="ferrox-tiny", input_len=24, output_len=8, num_requests=4,
                  max_concurrency=2, progress=False, result_json=str(tmp_path / f"{name}.json"))
    return bench_serving.run_benchmark(BenchConfig(**{**fields, **overrides}))


def test_completions_run_counts_exactly_max_tokens_and_prompt_tokens(server, tmp_path):
    result = bench(server, tmp_path, "c2", warmup_requests=1)
    assert result["completed"] == 4 and result["num_failed"] == 0, result["errors"]
    assert result["output_lens"] == [8] * 4, "ignore_eos + min_tokens pin every output at max_tokens"
    assert result["output_tokens_from"] == ["usage"] * 4, "the server sends usage when asked"
    assert result["total_output_tokens"] == 4 * 8 and result["num_output_len_mismatch"] == 0
    assert result["prompt_tokens_from"] == "server:/v1/tokenize"
    assert result["input_lens"] == [24] * 4, "prompts are composed to the server's exact token count"
    assert result["total_input_tokens"] == 4 * 24
    assert all(t is not None for t in result["ttfts_ms"]), "every stream produced text"
    assert len(result["finish_reasons"]) == 4, "the warm-up request is not among the results"
    saved = json.loads((tmp_path / "c2.json").read_text())
    missing = [f for f in VLLM_FIELDS + RUN_FIELDS if f not in saved]
    assert not missing, f"result JSON lacks {missing}"
    assert saved["request_rate"] is None, "an unlimited rate is stored as null (JSON has no inf)"
    assert saved["model"] == tiny_llama_name(server)


def tiny_llama_name(server: str) -> str:
    return httpx.get(server + "/v1/models", trust_env=False).json()["data"][0]["id"]


def test_chat_run_with_poisson_arrivals_streams_every_request(server, tmp_path):
    result = bench(server, tmp_path, "chat", endpoint="chat", num_requests=3, max_concurrency=None,
                   request_rate=50.0, output_len=6)
    assert result["completed"] == 3, result["errors"]
    assert result["output_lens"] == [6] * 3
    # the chat template wraps the 24-token prompt, so the server's count is larger
    assert all(n > 24 for n in result["input_lens"]), "chat prompt_tokens come from usage"


def test_without_usage_tokens_are_counted_from_text_chunks(server, tmp_path):
    result = bench(server, tmp_path, "chunks", include_usage=False, num_requests=2)
    assert result["output_tokens_from"] == ["chunks"] * 2
    # a tiny random model emits byte tokens whose text may be held back until a UTF-8
    # character completes, so chunks can be fewer than tokens but never more
    assert all(0 < n <= 8 for n in result["output_lens"]), result["output_lens"]


def test_local_tokenizer_prompts_match_the_servers_count(server, tmp_path, tiny_llama):
    result = bench(server, tmp_path, "local", tokenizer_model=str(tiny_llama), num_requests=2, input_len=17)
    assert result["prompt_tokens_from"] == f"local:{tiny_llama}"
    assert result["input_lens"] == [17, 17], "usage.prompt_tokens agrees with the local count"


def test_dataset_rows_set_prompt_and_output_length(server, tmp_path):
    rows = [{"prompt": "The quick brown fox", "output_len": 3}, {"prompt": "Hello world", "output_len": 5}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    result = bench(server, tmp_path, "dataset", dataset=str(path), num_requests=4)
    assert result["completed"] == 4, result["errors"]
    assert result["output_lens"] == [3, 5, 3, 5], "rows repeat in order to fill num_requests"


def test_composed_prompts_hit_exact_lengths(tiny_llama):
    tok = bench_prompts.load_local_tokenizer(str(tiny_llama))
    counter = bench_prompts.TokenCounter(lambda text: len(tok.encode(text)), "local", True)
    lengths = [1, 2, 15, 16, 17, 100]
    for n in lengths:
        (req,) = bench_prompts.synthetic_requests(counter, 1, n, 4, 0.0, seed=n)
        assert len(tok.encode(req.prompt)) == req.prompt_len_tokens == n, f"prompt of {n} tokens"
    a = bench_prompts.synthetic_requests(counter, 3, 20, 4, 0.5, seed=7)
    assert a == bench_prompts.synthetic_requests(counter, 3, 20, 4, 0.5, seed=7), "seeded: same prompts"
    assert len({r.prompt for r in a}) == 3 and all(10 <= r.prompt_len_tokens <= 30 for r in a)


def test_word_fallback_marks_lengths_unknown():
    counter = bench_prompts.TokenCounter(lambda text: len(text.split()), "words", False)
    (req,) = bench_prompts.synthetic_requests(counter, 1, 12, 4, 0.0, seed=0)
    assert len(req.prompt.split()) == 12 and req.prompt_len_tokens is None


def test_server_errors_are_counted_with_their_message(server, tmp_path):
    result = bench(server, tmp_path, "err", num_requests=2, extra_body='{"temperature": -1}')
    assert result["completed"] == 0 and result["num_failed"] == 2
    assert result["errors"][0].startswith("HTTP 400: "), result["errors"]
    assert result["mean_ttft_ms"] is None, "no successful request, no latency statistics"


def test_plot_of_two_result_files_writes_a_png(server, tmp_path):
    ours = bench(server, tmp_path, "ours-c1", max_concurrency=1, num_requests=2)
    peer = {**ours, "label": "peer", "output_throughput": ours["output_throughput"] / 2}
    (tmp_path / "peer-c1.json").write_text(json.dumps(peer))
    ours4 = {**ours, "max_concurrency": 4}
    (tmp_path / "ours-c4.json").write_text(json.dumps(ours4))
    files = [str(tmp_path / n) for n in ("ours-c1.json", "peer-c1.json", "ours-c4.json")]
    assert sorted(plot_bench.load_series(files)) == ["ferrox-tiny", "peer"], "one line per label"
    out = plot_bench.plot(files, str(tmp_path / "plot.png"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = plot_bench.markdown_table(files).splitlines()
    assert len(table) == 2 + 3, "header, separator, one row per result file"
    assert [row.split(" | ")[:2] for row in table[2:]] == [["| ferrox-tiny", "1"], ["| ferrox-tiny", "4"],
                                                          ["| peer", "1"]], "rows by label, then concurrency"


def test_shared_prefix_workload_sends_each_prefix_then_hits_it(server, tmp_path):
    result = bench(server, tmp_path, "shared", workload="shared-prefix", num_prefixes=2, prefix_len=40,
                   input_len=8, num_requests=6, max_concurrency=1, seed=123)
    assert result["completed"] == 6, result["errors"]
    assert result["groups"] == [0, 1, 0, 1, 0, 1] and result["turns"] == [0, 0, 1, 1, 1, 1], (
        "prefixes in turn; the first use of each is the cold request")
    cold, warm = result["cached_tokens"][:2], result["cached_tokens"][2:]
    assert cold == [0, 0] and all(c >= 32 for c in warm), "a 40-token prefix: 2 full blocks of 16 hit"
    summary = result["workload_summary"]
    assert summary["cold_ttft"]["n"] == 2 and summary["warm_ttft"]["n"] == 4


def test_multi_turn_workload_resends_the_whole_conversation(server, tmp_path):
    result = bench(server, tmp_path, "turns", workload="multi-turn", endpoint="chat", num_requests=2,
                   num_turns=3, prefix_len=20, input_len=6, output_len=4, max_concurrency=2, seed=321)
    assert result["completed"] == 6, result["errors"]
    assert result["groups"] == [0, 0, 0, 1, 1, 1] and result["turns"] == [0, 1, 2] * 2
    for conv in (result["input_lens"][:3], result["input_lens"][3:]):
        assert conv[0] < conv[1] < conv[2], "each turn resends the conversation so far"
    assert all(c > 0 for c, t in zip(result["cached_tokens"], result["turns"]) if t > 0), (
        "later turns hit the earlier turns' blocks")
    assert [s["n"] for s in result["workload_summary"]["ttft_by_turn"]] == [2, 2, 2]


def test_workload_options_are_checked():
    with pytest.raises(ValueError, match="--endpoint chat"):
        BenchConfig(base_url="http://127.0.0.1:9", label="x", workload="multi-turn")
    with pytest.raises(ValueError, match="workload"):
        BenchConfig(base_url="http://127.0.0.1:9", label="x", workload="zipf")
    cfg = bench_serving.parse_args(["--workload", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "900"])
    assert (cfg.workload, cfg.num_prefixes, cfg.prefix_len) == ("shared-prefix", 3, 900)


def test_non_loopback_hosts_are_refused_unless_allowed():
    with pytest.raises(ValueError, match="not loopback"):
        BenchConfig(base_url="http://10.1.2.3:8000", label="x")
    assert BenchConfig(base_url="http://10.1.2.3:8000", label="x", allow_remote=True).label == "x"
    assert bench_serving.is_loopback("127.0.0.1") and bench_serving.is_loopback("::1")
    assert bench_serving.is_loopback("localhost") and not bench_serving.is_loopback("example.com")


def test_cli_parses_into_the_config():
    cfg = bench_serving.parse_args(["--base-url", "http://127.0.0.1:8384/v1/", "--max-concurrency", "8",
                                    "--no-ignore-eos", "--endpoint", "chat"])
    assert cfg.base_url == "http://127.0.0.1:8384", "a trailing /v1 is dropped"
    assert cfg.label == "127.0.0.1:8384" and cfg.max_concurrency == 8
    assert cfg.ignore_eos is False and cfg.min_tokens is True and cfg.route == "/v1/chat/completions"


# ---------------------------------------------------------------- the SSE parser, hand-written streams


def stream_of(events: list[str], status: int = 200) -> httpx.MockTransport:
    body = "".join(events).encode()
    return httpx.MockTransport(lambda request: httpx.Response(status, content=body))


def chat_chunk(content: str | None, finish: str | None = None, usage: dict | None = None) -> str:
    delta = {} if content is None else {"content": content}
    chunk: dict = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        chunk = {"choices": [], "usage": usage}
    return f"data: {json.dumps(chunk)}\r\n\r\n"


def parse(transport: httpx.MockTransport, endpoint: str = "chat") -> bench_serving.RequestResult:
    cfg = BenchConfig(base_url="http://127.0.0.1:9", label="mock", endpoint=endpoint, include_usage=False)

    async def go():
        async with httpx.AsyncClient(base_url=cfg.base_url, transport=transport) as client:
            return await bench_serving.send_request(client, cfg, "m", BenchRequest("hi", 1, 3))

    return asyncio.run(go())


def test_parser_skips_comments_and_role_chunks_and_counts_text_chunks():
    result = parse(stream_of([": keep-alive\n\n", chat_chunk(None), chat_chunk("a"), "event: x\n\n",
                              chat_chunk("b"), chat_chunk(""), chat_chunk("c", "length"), "data: [DONE]\n\n"]))
    assert result.success and result.error is None
    assert result.num_text_chunks == 3 and result.output_tokens == 3 and result.output_tokens_from == "chunks"
    assert len(result.itl_s) == 2, "3 text chunks: 2 gaps"
    assert result.ttft_s is not None and result.finish_reason == "length"


def test_parser_prefers_usage_over_chunk_count():
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    result = parse(stream_of([chat_chunk("ab"), chat_chunk("cd"), chat_chunk(None, usage=usage), "data: [DONE]\n\n"]))
    assert result.output_tokens == 4 and result.output_tokens_from == "usage" and result.prompt_len_tokens == 5


def test_parser_reads_completions_text():
    chunk = 'data: {"choices": [{"index": 0, "text": "xy", "finish_reason": null}]}\n\n'
    result = parse(stream_of([chunk, chunk, "data: [DONE]\n\n"]), endpoint="completions")
    assert result.success and result.num_text_chunks == 2 and result.text_chars == 4


def test_parser_reports_errors_in_band_and_out():
    mid = parse(stream_of([chat_chunk("a"), 'data: {"error": {"message": "engine died"}}\n\n']))
    assert not mid.success and mid.error == "stream error: engine died"
    refused = parse(stream_of(['{"error": {"message": "queue full", "type": "x"}}'], status=503))
    assert not refused.success and refused.error == "HTTP 503: queue full"
    cut = parse(stream_of([chat_chunk("a")]))
    assert not cut.success and "[DONE]" in cut.error, "a stream cut short is a failure"
    garbage = parse(stream_of(["data: {not json\n\n"]))
    assert not garbage.success and garbage.error.startswith("JSONDecodeError")
