"""The settings table: every `ferrox serve` setting, its flag and its FERROX_* variable.

Each setting is a CLI flag and an environment variable (the ferrox-server contract's
names where it has one: FERROX_MODEL_PATH, FERROX_ADDR, FERROX_API_KEY, FERROX_CB_*), in a
`--help` group (api/cli_help.py). Precedence: flag > variable > default. This module is
the only place that reads the environment (`env_defaults`). `api/cli.py` turns the merged
values into `ServerConfig` (HTTP concerns, `api/config.py`) and the engine's one
`EngineConfig` (`ferrox_jax/config.py`). Invalid values stop start-up with a message naming
the variable; a message from the engine or a config check names the flag and variable
(`name_settings`). Settings that hold a secret (`Setting.is_secret`) never show their value,
in `--help` or anywhere else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Mapping

from api.config import DEFAULT_HOST, DEFAULT_PORT, MIB
from ferrox_jax.constraint import GrammarError, GrammarSpec, grammar_syntax
from ferrox_jax.request import MAX_LOGPROBS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be 1/0, true/false, yes/no or on/off")


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _host_names(text: str) -> tuple[str, ...]:
    return tuple(n.strip().lower() for n in text.split(",") if n.strip())


def _str(text: str) -> str:
    return text


def _lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """'name=path' pairs, separated by spaces or commas."""
    pairs = []
    for item in text.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"expected name=path, got {item!r}")
        pairs.append((name, path))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # argparse dest
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    flag: str = ""  # defaults to --name-with-dashes
    group: str = ""  # the `--help=GROUP` page it is listed on (api/cli_help.py describes the groups)
    is_secret: bool = False  # a key or secret: `--help` never prints its value (from its variable)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    # engine (ferrox_jax.config.EngineConfig)
    Setting("model", "FERROX_MODEL_PATH", _str, "default",
            "HF folder, .gguf file, or 'default' (embedded SmolLM2-135M-Instruct)", group="model"),
    Setting("served_model_name", "FERROX_SERVED_MODEL_NAME", _str, None,
            "model id clients send (default: the checkpoint's file or folder stem)", group="model"),
    Setting("dtype", "FERROX_DTYPE", _str, None, "float32 or bfloat16 (default: per platform)", group="model"),
    Setting("load_format", "FERROX_LOAD_FORMAT", _str, "auto",
            "auto (read the weights) or dummy (random weights from the config alone: sizing, benchmarks)",
            group="model"),
    Setting("mmproj", "FERROX_MMPROJ", _str, None,
            "llama.cpp's projector GGUF (mmproj) beside a Gemma 3 GGUF: the model then takes images",
            group="model"),
    Setting("dummy_weights_seed", "FERROX_DUMMY_WEIGHTS_SEED", _nonneg_int, 0,
            "seed of --load-format dummy (same seed, same weights)", group="model"),
    Setting("quantization", "FERROX_QUANTIZATION", _str, "auto",
            "weights: none, int8 (weight-only; fused on TPU/GPU, slower on CPU), w8a8 (int8 weights and "
            "per-token int8 activations), gguf (a GGUF's Q4_0/Q4_1/Q8_0/K-quant/MXFP4 blocks, or an HF "
            "checkpoint's MXFP4 experts, as shipped, on ferrox's CPU block kernels) or auto (gguf for such "
            "a checkpoint on one CPU device, else none)", group="model"),
    Setting("int8_kernel", "FERROX_INT8_KERNEL", _str, "auto",
            "w8a8 projections on CPU: auto (ferrox's AVX2 int8 kernel when built, one device) or xla "
            "(XLA's int8 dot)", group="model"),
    Setting("block_size", "FERROX_CB_KV_BLOCK_SIZE", _positive_int, 16, "KV positions per block", group="cache"),
    Setting("kv_blocks", "FERROX_CB_KV_BLOCKS", _positive_int, None,
            "KV blocks requests can use, the stats' kv_blocks_total (the null block is added; default: "
            "derived from the memory budget)", group="cache"),
    Setting("kv_memory_gib", "FERROX_KV_MEMORY_GIB", _positive_float, None,
            "KV cache memory budget in GiB (default: what --max-seqs rows of a whole context need, "
            "at most 2 GiB)", group="cache"),
    Setting("kv_cache_dtype", "FERROX_KV_CACHE_DTYPE", _str, None,
            "KV cache storage: float32, bfloat16 or float16 (default: float16 for a GGUF served as its "
            "own blocks on CPU, as llama.cpp keeps it; else the compute dtype); the same budget holds "
            "proportionally more blocks", group="cache"),
    Setting("max_context", "FERROX_CB_MAX_CONTEXT", _positive_int, None,
            "per-request context ceiling in tokens (default: the model's trained context, within budget)",
            group="cache"),
    Setting("compile_cache_dir", "FERROX_COMPILE_CACHE_DIR", _str, None,
            "JAX persistent compilation cache (default: ~/.cache/ferrox_jax/jax; 'off' disables)", group="model"),
    Setting("executable_store", "FERROX_EXECUTABLE_STORE", _bool, True,
            "keep the compiled step executables serialized under the compile cache dir, so a restart loads "
            "them without tracing (CPU, one process; --no-executable-store: JAX's compile cache only)",
            group="model"),
    Setting("executable_store_max_gib", "FERROX_EXECUTABLE_STORE_MAX_GIB", _nonneg_float, 2.0,
            "disk bound of the executable store in GiB: once warm, a start removes the folders of other "
            "versions, models and settings, least recently used first, until the store fits; never one a "
            "running server uses or one used within the hour (0: unbounded)", group="model"),
    Setting("tensor_parallel", "FERROX_TENSOR_PARALLEL", _positive_int, 1,
            "devices to shard the model over (the mesh's model axis)", group="parallel"),
    Setting("mesh", "FERROX_MESH", _str, None,
            "device mesh, e.g. data=1,model=4 (data must be 1; overrides --tensor-parallel)", group="parallel"),
    Setting("replicate_attention", "FERROX_REPLICATE_ATTENTION", _bool, False,
            "shard only MLP and vocab; needed when heads do not divide the model axis (SmolLM2: 9 heads, 3 KV)",
            group="parallel"),
    Setting("expert_parallel", "FERROX_EXPERT_PARALLEL", _str, "auto",
            "routed experts on a mesh: on = split by expert over the model axis (E / devices whole experts "
            "each; the device count must divide E), off = each expert split over its intermediate axis, "
            "auto = on for 32 experts or more when the device count divides them", group="parallel"),
    Setting("attention_impl", "FERROX_ATTENTION_IMPL", _str, "auto",
            "decode attention: auto (Pallas kernel on TPU when it fits, ferrox's AVX2 kernel on an x86 CPU), "
            "jax, cpu, pallas, "
            "pallas-gpu, gather-xla, gather-cudnn", group="model"),
    Setting("coordinator_address", "FERROX_COORDINATOR_ADDRESS", _str, None,
            "multi-host: jax.distributed coordinator host:port, or 'auto' on a TPU pod", group="parallel"),
    Setting("num_processes", "FERROX_NUM_PROCESSES", _positive_int, None, "multi-host: number of processes",
            group="parallel"),
    Setting("process_id", "FERROX_PROCESS_ID", _nonneg_int, None, "multi-host: this process's index", group="parallel"),
    Setting("multihost_timeout_s", "FERROX_MULTIHOST_TIMEOUT_S", _positive_float, 10.0,
            "multi-host: seconds without a step or heartbeat after which a peer is taken for hung "
            "(the group fails and exits)", group="parallel"),
    Setting("multihost_secret", "FERROX_MULTIHOST_SECRET", _str, None,
            "multi-host: the shared secret every process proves it knows before the step channel carries a step "
            "(the same on every process, at least 16 characters; required unless the coordinator is on loopback, "
            "where the leader generates one for its followers); prefer the variable to the flag, which other "
            "users can read in the process list", group="parallel", is_secret=True),
    Setting("share_compiles", "FERROX_SHARE_COMPILES", _bool, True,
            "multi-host: process 0 compiles each step shape and the other processes load its executable "
            "instead of compiling it themselves (--no-share-compiles: every process compiles)", group="parallel"),
    Setting("max_seqs", "FERROX_CB_MAX_SEQS", _positive_int, 32,
            "rows (prefilling + decoding) at once; also the largest decode row bucket", group="scheduler"),
    Setting("prefill_chunk", "FERROX_CB_PREFILL_CHUNK", _positive_int, 128, "prompt tokens per chunk",
            group="scheduler"),
    Setting("max_batched_tokens", "FERROX_CB_MAX_BATCHED_TOKENS", _nonneg_int, 0,
            "prompt tokens per step over all its chunks (one chunk per prefilling job; decode rows always run "
            "besides); 0 = the backend's default (one chunk on CPU)", group="scheduler"),
    Setting("prefill_chunk_idle", "FERROX_PREFILL_CHUNK_IDLE", _nonneg_int, 0,
            "prompt tokens per tick while no row decodes (0 = --prefill-chunk; larger buckets compile at start-up)",
            group="scheduler"),
    Setting("max_queue", "FERROX_CB_MAX_QUEUE", _positive_int, 512, "waiting jobs before 503", group="scheduler"),
    Setting("scheduling_policy", "FERROX_SCHEDULING_POLICY", _str, "fcfs",
            "fcfs (first come first served: every request has priority 0) or priority (a request's integer "
            "`priority` or x-priority header, lower first; a more urgent request preempts less urgent running "
            "ones, which recompute and reply exactly as if never preempted)", group="scheduler"),
    Setting("step_timeout_s", "FERROX_STEP_TIMEOUT_S", _nonneg_float, 600.0,
            "seconds one engine step may run after warm-up before the engine is declared hung: in-flight "
            "requests end with an error and the process exits 4 (0 = no watchdog)", group="scheduler"),
    Setting("max_step_faults", "FERROX_MAX_STEP_FAULTS", _positive_int, 3,
            "failed engine steps in a row before the engine gives up and the process exits 3", group="scheduler"),
    Setting("prefix_caching", "FERROX_PREFIX_CACHING", _bool, True,
            "keep computed prompt blocks and reuse them for prompts sharing a prefix (--no-prefix-caching: off)",
            group="cache"),
    Setting("state_snapshots", "FERROX_STATE_SNAPSHOTS", _nonneg_int, 0,
            "a model with recurrent (linear-attention) layers: state snapshot slots kept for prefix-cache hits "
            "(0 = two per row in flight, 2 x --max-seqs: a running row's prompt and decode snapshots)",
            group="cache"),
    Setting("state_snapshot_interval", "FERROX_STATE_SNAPSHOT_INTERVAL", _nonneg_int, 32,
            "a model with recurrent layers: a prompt's state is snapshotted every this many blocks (a chunk is "
            "cut to end on each), so prompts sharing only a long system prompt hit its last such boundary; "
            "besides, every prompt's last full block and each row's latest one (a chat's next turn) are kept "
            "(0 = those only; each snapshot costs a slot of every DeltaNet layer's state)", group="cache"),
    Setting("kv_offload_gib", "FERROX_KV_OFFLOAD_GIB", _nonneg_float, 0.0,
            "host memory in GiB for prefix-cache blocks the device cache evicts: copied out, and copied back "
            "on a later hit instead of recomputed (0 = off; one process only, needs prefix caching)",
            group="cache"),
    Setting("speculative", "FERROX_SPECULATIVE", _str, None,
            "speculative decoding: ngram (prompt lookup over the row's own prompt and output), draft "
            "(--draft-model's autoregressive drafts) or mtp (the checkpoint's own multi-token-prediction "
            "layer: DeepSeek-V3, Qwen3.5, Qwen3.5-MoE, Qwen3-Next); default off", group="speculative"),
    Setting("draft_model", "FERROX_DRAFT_MODEL", _str, None,
            "--speculative draft: a smaller checkpoint with the target's tokenizer (its KV shares the block budget)",
            group="speculative"),
    Setting("num_speculative_tokens", "FERROX_NUM_SPECULATIVE_TOKENS", _positive_int, 3,
            "draft tokens a speculating row verifies per step", group="speculative"),
    Setting("max_speculative_tokens", "FERROX_MAX_SPECULATIVE_TOKENS", _nonneg_int, 0,
            "adaptive draft length: a row whose drafts were all accepted verifies twice as many tokens next step "
            "(k -> 2k + 1 drafts), up to this many drafts; a rejection sends it back to --num-speculative-tokens "
            "(0: fixed length)", group="speculative"),
    Setting("ngram_min", "FERROX_NGRAM_MIN", _positive_int, 2, "shortest suffix prompt lookup matches",
            group="speculative"),
    Setting("ngram_max", "FERROX_NGRAM_MAX", _positive_int, 4, "longest suffix prompt lookup matches (tried first)",
            group="speculative"),
    Setting("speculative_max_rows", "FERROX_SPECULATIVE_MAX_ROWS", _positive_int, 4,
            "a step with more decoding rows than this does not speculate", group="speculative"),
    Setting("speculative_config", "FERROX_SPECULATIVE_CONFIG", _str, None,
            "vLLM-style JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
            "\"prompt_lookup_max\": 4}' (overrides the flags above)", group="speculative"),
    # server (ServerConfig)
    Setting("addr", "FERROX_ADDR", _str, None, "host:port (overridden by --host/--port)", group="server"),
    Setting("host", "FERROX_HOST", _str, None, f"bind address (default {DEFAULT_HOST})", group="server"),
    Setting("port", "FERROX_PORT", _nonneg_int, None,
            f"port (default {DEFAULT_PORT}; 0: a free port, named in the ready line on stdout)", group="server"),
    Setting("exit_on_stdin_close", "FERROX_EXIT_ON_STDIN_CLOSE", _bool, False,
            "drain and exit when stdin reaches its end (a parent process that dies takes the server with it)",
            group="server"),
    Setting("api_key", "FERROX_API_KEY", _str, None, "require 'Authorization: Bearer KEY'", group="server",
            is_secret=True),
    Setting("allow_unauthenticated_remote", "FERROX_ALLOW_UNAUTHENTICATED_REMOTE", _bool, False,
            "allow a non-loopback bind without an API key", group="server"),
    Setting("max_body_bytes", "FERROX_MAX_BODY_BYTES", _positive_int, 4 * MIB, "request body limit (413 above)",
            group="limits"),
    Setting("max_n", "FERROX_MAX_N", _positive_int, 16, "largest n per request", group="limits"),
    Setting("max_stop_strings", "FERROX_MAX_STOP_STRINGS", _positive_int, 16, "stop strings per request",
            group="limits"),
    Setting("max_stop_chars", "FERROX_MAX_STOP_CHARS", _positive_int, 256, "characters per stop string",
            group="limits"),
    Setting("max_images", "FERROX_MAX_IMAGES", _positive_int, 8, "images per request (a model taking images)",
            group="limits"),
    Setting("max_image_bytes", "FERROX_MAX_IMAGE_BYTES", _positive_int, 20 * MIB, "bytes of one image file",
            group="limits"),
    Setting("max_image_pixels", "FERROX_MAX_IMAGE_PIXELS", _positive_int, 40_000_000,
            "pixels (width x height) of one image, read from its header before decoding", group="limits"),
    Setting("allowed_media_domains", "FERROX_ALLOWED_MEDIA_DOMAINS", _host_names, (),
            "comma-separated hosts image URLs may be fetched from ('.example.com': a domain and its hosts; IP "
            "addresses and networks such as 10.0.0.0/8 for internal hosts, which a name never reaches); default: "
            "none, only inline images", group="limits"),
    Setting("max_prompt_tokens", "FERROX_MAX_PROMPT_TOKENS", _nonneg_int, 0,
            "tokens per prompt (0 = the context ceiling; 400 above)", group="limits"),
    Setting("max_output_tokens", "FERROX_MAX_OUTPUT_TOKENS", _nonneg_int, 0,
            "largest max_tokens a request may ask (0 = the room left in the context; 400 above)", group="limits"),
    Setting("max_logprobs", "FERROX_MAX_LOGPROBS", _nonneg_int, MAX_LOGPROBS,
            f"largest logprobs / top_logprobs (at most {MAX_LOGPROBS})", group="limits"),
    Setting("max_reply_entries", "FERROX_MAX_REPLY_ENTRIES", _positive_int, 1 << 20,
            "token entries one reply may hold: prompts x n x max_tokens (plus the prompt with echo) x "
            "(1 + logprobs) (400 above, before generating)", group="limits"),
    Setting("max_concurrent_requests", "FERROX_MAX_CONCURRENT_REQUESTS", _positive_int, 1024,
            "open HTTP requests at once, /health and /metrics excluded (503 above)", group="limits"),
    Setting("max_header_bytes", "FERROX_MAX_HEADER_BYTES", _positive_int, 64 * 1024,
            "request line + headers in bytes (Hypercorn closes the connection above)", group="limits"),
    Setting("backlog", "FERROX_BACKLOG", _positive_int, 128, "listen backlog: connections not yet accepted",
            group="limits"),
    Setting("keep_alive_timeout", "FERROX_KEEP_ALIVE_TIMEOUT", _positive_float, 5.0,
            "seconds an idle keep-alive connection stays open", group="limits"),
    Setting("request_timeout", "FERROX_REQUEST_TIMEOUT", _positive_float, 600.0,
            "seconds a non-streaming generation may take (504 and cancelled above)", group="limits"),
    Setting("sse_orphan_timeout_ms", "FERROX_SSE_ORPHAN_TIMEOUT_MS", _positive_int, 30_000,
            "ms a stream may wait on a client that reads nothing before it is cancelled", group="limits"),
    Setting("cors_origins", "FERROX_CORS_ORIGINS", _origins, (), "comma-separated exact CORS origins", group="server"),
    Setting("allowed_hosts", "FERROX_ALLOWED_HOSTS", _host_names, (),
            "comma-separated host names the server answers to besides localhost, the bound address and IP "
            "addresses ('.example.com': a domain and its subdomains; '*': any); others get 421 (default: none "
            "on a loopback bind, any name on another)", group="server"),
    Setting("rate_limit_per_minute", "FERROX_RATE_LIMIT_PER_MINUTE", _nonneg_int, 0,
            "requests per minute per client address (0 = off; 429 above)", group="limits"),
    Setting("auth_failures_per_minute", "FERROX_AUTH_FAILURES_PER_MINUTE", _nonneg_int, 20,
            "wrong API keys per minute per client address before its requests get 429 (0 = off)", group="limits"),
    Setting("body_read_timeout", "FERROX_BODY_READ_TIMEOUT", _positive_float, 10.0,
            "seconds a request body may take to arrive, plus 1 s per 64 KiB received (408 above)", group="limits"),
    Setting("cpu_workers", "FERROX_CPU_WORKERS", _positive_int, 2,
            "threads that run CPU-heavy request steps (chat templates, long texts, big bodies) off the event "
            "loop, so /health keeps answering", group="limits"),
    Setting("gc_freeze", "FERROX_GC_FREEZE", _bool, True,
            "once the engine is up, keep its objects out of full garbage collections, which would otherwise "
            "stall every connection for ~1 s (--no-gc-freeze: off)", group="server"),
    Setting("tls_cert", "FERROX_TLS_CERT", _str, None, "TLS certificate file (with --tls-key)", group="server"),
    Setting("tls_key", "FERROX_TLS_KEY", _str, None, "TLS private key file (with --tls-cert)", group="server"),
    Setting("shutdown_timeout", "FERROX_SHUTDOWN_TIMEOUT", _nonneg_float, 30.0,
            "seconds in-flight requests get to finish on SIGTERM", group="server"),
    Setting("log_level", "FERROX_LOG_LEVEL", _str, "info", "debug, info, warning, error", group="server"),
    Setting("otlp_traces_endpoint", "FERROX_OTLP_TRACES_ENDPOINT", _str, None,
            "send a trace of every generation request to this OTLP collector (http/protobuf: a URL, "
            "/v1/traces when it has no path; grpc: host:port); needs the otel extra; default: off",
            group="server"),
    Setting("otlp_traces_protocol", "FERROX_OTLP_TRACES_PROTOCOL", _str, "http/protobuf",
            "the OTLP transport for --otlp-traces-endpoint: http/protobuf or grpc", group="server"),
    # structured output: a constraint for requests that give none (at most one of the three)
    Setting("grammar", "FERROX_GRAMMAR", _str, None,
            "default output grammar, Lark or GBNF, for generation requests that give no constraint", group="output"),
    Setting("grammar_file", "FERROX_GRAMMAR_FILE", _str, None, "read the default output grammar from this file",
            group="output"),
    Setting("json_schema", "FERROX_JSON_SCHEMA", _str, None,
            "default output JSON schema (JSON text, strict) for generation requests that give no constraint",
            group="output"),
    Setting("grammar_sandbox", "FERROX_GRAMMAR_SANDBOX", _bool, True,
            "compile each new output constraint in a child process first, so a crash in the compiler is that "
            "request's 400, not the server's end (--no-grammar-sandbox: in-process only)", group="output"),
    Setting("grammar_workers", "FERROX_GRAMMAR_WORKERS", _positive_int, 2,
            "child processes that compile new output constraints", group="output"),
    Setting("grammar_timeout_s", "FERROX_GRAMMAR_TIMEOUT_S", _positive_float, 15.0,
            "seconds one output constraint may take to compile in a child process (400 above)", group="output"),
    Setting("model_dir", "FERROX_MODEL_DIR", _str, None,
            "folder of local checkpoints (HF folders, .gguf files) /admin/models lists and loads", group="server"),
    Setting("resumable_max_bytes", "FERROX_RESUMABLE_MAX_BYTES", _positive_int, MIB,
            "bytes of events one resumable stream keeps for replay (410 replay_window_lost beyond)", group="sessions"),
    Setting("resumable_ttl", "FERROX_RESUMABLE_TTL", _positive_float, 300.0,
            "seconds a finished resumable stream is kept for replay", group="sessions"),
    Setting("resumable_max_streams", "FERROX_RESUMABLE_MAX_STREAMS", _positive_int, 256,
            "resumable streams kept at once (the oldest finished one makes room)", group="sessions"),
    Setting("web_ui", "FERROX_WEB_UI", _bool, True,
            "serve the chat page at / and the live dashboard at /dashboard (--no-web-ui: off)", group="server"),
    Setting("session_max", "FERROX_SESSION_MAX", _positive_int, 1024,
            "chat sessions (session_id) kept at once; the least recently used one makes room", group="sessions"),
    Setting("session_ttl", "FERROX_SESSION_TTL", _positive_float, 3600.0,
            "seconds an unused chat session is kept", group="sessions"),
    Setting("session_max_bytes", "FERROX_SESSION_MAX_BYTES", _positive_int, MIB,
            "bytes one chat session's turns may take (its oldest exchanges make room; a request whose "
            "messages alone are larger gets 400)", group="sessions"),
    Setting("session_max_total_bytes", "FERROX_SESSION_MAX_TOTAL_BYTES", _positive_int, 64 * MIB,
            "bytes all chat sessions' turns may take together (the least recently used sessions make room)",
            group="sessions"),
    Setting("response_cache", "FERROX_RESPONSE_CACHE", _bool, False,
            "answer a repeated greedy or seeded request from memory (header ferrox-cache: hit|miss|skip)",
            group="sessions"),
    Setting("response_cache_max_entries", "FERROX_RESPONSE_CACHE_MAX_ENTRIES", _positive_int, 1024,
            "responses the response cache keeps (the least recently used makes room)", group="sessions"),
    Setting("rerank_scheme", "FERROX_RERANK_SCHEME", _str, "auto",
            "how /v1/rerank and /v1/score score a pair: yes-no (Qwen3-Reranker's logits), embedding (cosine), "
            "or auto (yes-no when the model id names a reranker)", group="model"),
    Setting("response_cache_max_bytes", "FERROX_RESPONSE_CACHE_MAX_BYTES", _positive_int, 64 * MIB,
            "bytes the response cache's entries may take", group="sessions"),
    # LoRA adapters (models/lora.py; docs/api.md, "LoRA adapters")
    Setting("max_loras", "FERROX_MAX_LORAS", _nonneg_int, 0,
            "LoRA adapter slots on the device (0 = no LoRA); a request picks an adapter by its name in `model`",
            group="lora"),
    Setting("max_lora_rank", "FERROX_MAX_LORA_RANK", _positive_int, 16, "largest LoRA rank a slot holds", group="lora"),
    Setting("lora_modules", "FERROX_LORA_MODULES", _lora_modules, (),
            "PEFT adapters loaded at start-up: name=path ... (needs --max-loras)", group="lora"),
    Setting("enable_runtime_lora", "FERROX_ENABLE_RUNTIME_LORA", _bool, False,
            "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths inside --model-dir only)",
            group="lora"),
)


_SETTING_BY_NAME = {s.name: s for s in SETTINGS}


def setting_label(name: str) -> str | None:
    """"--kv-blocks (FERROX_CB_KV_BLOCKS)" for a setting's name (an EngineConfig or
    ServerConfig field of the same name); None for a name the table does not have."""
    found = _SETTING_BY_NAME.get(name)
    return None if found is None else f"{found.cli_flag} ({found.env})"


def name_settings(message: str, field: str | None = None) -> str:
    """An engine or config message as a user of `ferrox serve` reads it: each
    `EngineConfig.<name>` / `ServerConfig.<name>`, and `field` where it opens the message
    or follows "at most" (a `MemoryBoundError`), named as its flag and variable."""
    label = setting_label(field) if field else None
    if label is not None and message.startswith(field + " "):
        message = label + message[len(field):]
    if label is not None:
        message = message.replace(f"at most {field} ", f"at most {_SETTING_BY_NAME[field].cli_flag} ")
    return re.sub(r"\b(?:EngineConfig|ServerConfig)\.(\w+)", lambda m: setting_label(m.group(1)) or m.group(0),
                  message)


def default_grammar(grammar: str | None, grammar_file: str | None, json_schema: str | None) -> GrammarSpec | None:
    """The server-wide constraint from --grammar / --grammar-file / --json-schema (at most
    one). The engine compiles it at start-up, so an unenforceable one stops the server.

    Raises:
      ValueError naming the flag: more than one given, an unreadable file, invalid JSON.
    """
    given = [flag for flag, value in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                      ("--json-schema", json_schema)) if value]
    if len(given) > 1:
        raise ValueError(f"give at most one default constraint; got {' and '.join(given)}")
    try:
        if grammar:
            return GrammarSpec.grammar(grammar, syntax=grammar_syntax(grammar))
        if grammar_file:
            try:
                with open(grammar_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"--grammar-file {grammar_file!r}: {e.strerror}") from None
            return GrammarSpec.grammar(text, syntax=grammar_syntax(text))
        if json_schema:
            try:
                schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"--json-schema is not valid JSON: {e}") from None
            return GrammarSpec.json_schema(schema)
    except GrammarError as e:
        raise ValueError(f"{given[0]}: {e}") from None
    return None


def env_defaults(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Each setting's default, replaced by its FERROX_* variable where set.

    Raises:
      SystemExit naming the variable when a value does not parse.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for s in SETTINGS:
        text = environ.get(s.env)
        if text is None:
            out[s.name] = s.default
            continue
        try:
            out[s.name] = s.parse(text)
        except ValueError as e:
            raise SystemExit(f"invalid {s.env}={text!r}: {e}") from None
    return out


def split_addr(addr: str) -> tuple[str, int]:
    """'127.0.0.1:8383' / '[::1]:8383' / '0.0.0.0' -> (host, port)."""
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif addr.count(":") == 1:
        host, port_text = addr.split(":")
    else:
        host, port_text = addr, ""
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise SystemExit(f"invalid FERROX_ADDR / address {addr!r}: port must be a number") from None
    return host or DEFAULT_HOST, port
