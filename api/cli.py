"""The `ferrox` console script: `ferrox serve` (the HTTP server), `ferrox run-batch` (an OpenAI
Batch file answered offline: api/batch.py) and `ferrox generate` (one prompt).

It sits on the top floor: it wires `api/` and the engine together. Every
`serve` setting is a flag and a FERROX_* variable (api/settings.py holds the table);
`--help` shows the essential flags and the groups, `--help=all` / `--help=GROUP` /
`--help=WORD` the rest (api/cli_help.py).

`serve` binds its port before anything else (a port in use, or one this user may not
have, stops it with one line), then starts Hypercorn, so `/health` answers `loading` (503) while the weights
load and every bucket compiles (progress bars on stderr), then `ready`; one log block
names the model, dtype, devices, KV blocks and bytes, buckets, the resident memory and its
parts (api/process_memory.py) and URL. SIGTERM/SIGINT
drain: /health and new work turn 503, in-flight requests get `--shutdown-timeout`
seconds, the rest are cancelled, and the process exits 0. An engine that gives up (a step
hung past `--step-timeout-s`, `--max-step-faults` failed steps in a row, a crashed owner
loop) has already ended every in-flight request with an error; the server then stops and
the process exits non-zero (`EXIT_*`, docs/operations.md) so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import queue
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from api import cli_help
from api.config import DEFAULT_HOST, DEFAULT_PORT, ServerConfig
from api.process_memory import describe_rss
from api.settings import SETTINGS, default_grammar, env_defaults, name_settings, split_addr

if TYPE_CHECKING:  # the facade's module imports jax: `ferrox --help` stays without it
    from ferrox_jax.engine import Engine, EngineConfig, SpeculativeConfig

logger = logging.getLogger("ferrox")

# `ferrox serve` exit statuses (docs/operations.md has the table and what a supervisor does).
EXIT_OK = 0  # SIGTERM/SIGINT drain, or stdin closed with --exit-on-stdin-close
EXIT_LOAD_FAILED = 1  # the model did not load (a bad checkpoint or setting)
EXIT_ENGINE_FAULTED = 3  # repeated failed steps, a lost multi-host peer, or a crashed owner loop
EXIT_ENGINE_HUNG = 4  # a step ran past --step-timeout-s (the device is hung or gone)
# `ferrox run-batch`: -i / -o cannot be used (missing, the same file, unwritable); nothing was loaded.
EXIT_BAD_FILES = 2


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    defaults = env_defaults(environ)
    parser = argparse.ArgumentParser(prog="ferrox", description="OpenAI-compatible LLM server on JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    # serve and run-batch take every setting: their --help is grouped (api/cli_help.py).
    serve = sub.add_parser("serve", help="run the HTTP server", description="Serve a model over HTTP.",
                           usage="%(prog)s [--help[=all|GROUP|WORD]] [options]", add_help=False,
                           formatter_class=cli_help.DefaultsFormatter)
    _add_settings(serve, defaults, cli_help.ESSENTIAL)
    batch = sub.add_parser("run-batch", help="answer an OpenAI Batch file (JSONL) offline, in-process",
                           description="Answer an OpenAI Batch file offline, in this process.",
                           usage="%(prog)s -i INPUT -o OUTPUT [--help[=all|GROUP|WORD]] [options]", add_help=False,
                           formatter_class=cli_help.DefaultsFormatter)
    files = batch.add_argument_group("run-batch", "the batch itself")
    files.add_argument("-i", "--input-file", required=True, help="requests, one JSON line each ('-': stdin)")
    files.add_argument("-o", "--output-file", required=True, help="answers, one JSON line each ('-': stdout)")
    files.add_argument("--max-concurrency", type=int, default=None,
                       help="lines in flight at once (default: twice --max-seqs)")
    files.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_settings(batch, defaults, cli_help.ESSENTIAL_OFFLINE)
    gen = sub.add_parser("generate", help="generate from one prompt and print the text")
    gen.add_argument("prompt", help="prompt text (a user message with --chat)")
    gen.add_argument("--model", default=defaults["model"], help="HF folder, .gguf, or 'default'")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default=defaults["dtype"])
    gen.add_argument("--quantization", default=defaults["quantization"], help="none, int8, w8a8, w8a8-block32 (32-wide activation scales), gguf (a GGUF's own blocks) or auto")
    gen.add_argument("--kv-memory-gib", type=float, default=0.25, help="KV cache budget (one request needs little)")
    gen.add_argument("--log-level", default="warning")
    return parser


def _add_settings(parser: argparse.ArgumentParser, defaults: dict[str, Any], essential: Sequence[str]) -> None:
    """Every setting of the table as a flag (its FERROX_* variable the default), in its
    group, and the grouped -h / --help[=TOPIC] (`essential`: the flags its first page lists)."""
    groups = cli_help.add_groups(parser, essential)
    for s in SETTINGS:
        group = groups[cli_help.group_of(s.group)]
        if s.parse.__name__ == "_bool":
            # A setting on by default gets --no-<flag> too, to turn it off from the command line.
            action = argparse.BooleanOptionalAction if s.default else "store_true"
            group.add_argument(s.cli_flag, dest=s.name, action=action, default=defaults[s.name],
                               help=f"{s.help} [{s.env}]")
            continue
        if s.parse.__name__ == "_lora_modules":  # vLLM's form: --lora-modules a=PATH b=PATH
            group.add_argument(s.cli_flag, dest=s.name, type=s.parse, nargs="+", default=defaults[s.name],
                               help=f"{s.help} [{s.env}]", metavar="NAME=PATH")
            continue
        action = group.add_argument(s.cli_flag, dest=s.name, type=s.parse, default=defaults[s.name],
                                    help=f"{s.help} [{s.env}]", metavar=s.name.upper())
        action.is_secret = s.is_secret  # cli_help.DefaultsFormatter prints no value for it


def main(argv: Sequence[str] | None = None, wrap_runner: Callable[[Any], Any] | None = None) -> int:
    """`wrap_runner`: the engine builder's runner-wrapping hook for `serve`'s engines (test
    fault injection, `tests/support/fault_serve.py`); None in every product use."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ferrox_jax.engine import cap_xla  # imports jax, starts no backend: XLA reads XLA_FLAGS when one starts

    try:
        cap_xla()
    except ValueError as e:
        raise SystemExit(f"ferrox: {e}") from None
    if args.command == "serve":
        return serve(args, wrap_runner)
    if args.command == "run-batch":
        return run_batch(args)
    return generate(args)


# ---------------------------------------------------------------- configs from arguments


def server_config(args: argparse.Namespace) -> ServerConfig:
    host, port = split_addr(args.addr) if args.addr else (DEFAULT_HOST, DEFAULT_PORT)
    try:
        return ServerConfig(
            host=args.host or host, port=port if args.port is None else args.port, api_key=args.api_key,
            max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars, max_prompt_tokens=args.max_prompt_tokens,
            max_images=args.max_images, max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
            allowed_media_domains=tuple(args.allowed_media_domains),
            max_output_tokens=args.max_output_tokens, max_logprobs=args.max_logprobs,
            max_reply_entries=args.max_reply_entries,
            max_concurrent_requests=args.max_concurrent_requests, max_header_bytes=args.max_header_bytes,
            backlog=args.backlog, keep_alive_timeout_s=args.keep_alive_timeout,
            request_timeout_s=args.request_timeout, sse_orphan_timeout_ms=args.sse_orphan_timeout_ms,
            cors_origins=tuple(args.cors_origins), allowed_hosts=tuple(args.allowed_hosts),
            rate_limit_per_minute=args.rate_limit_per_minute,
            auth_failures_per_minute=args.auth_failures_per_minute, body_read_timeout_s=args.body_read_timeout,
            allow_unauthenticated_remote=args.allow_unauthenticated_remote, tls_cert=args.tls_cert,
            tls_key=args.tls_key, shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
            default_grammar=default_grammar(args.grammar, args.grammar_file, args.json_schema),
            model_dir=args.model_dir, resumable_max_bytes=args.resumable_max_bytes,
            resumable_ttl_s=args.resumable_ttl, resumable_max_streams=args.resumable_max_streams,
            web_ui=args.web_ui, session_max=args.session_max, session_ttl_s=args.session_ttl,
            session_max_bytes=args.session_max_bytes, session_max_total_bytes=args.session_max_total_bytes,
            response_cache=args.response_cache, response_cache_max_entries=args.response_cache_max_entries,
            response_cache_max_bytes=args.response_cache_max_bytes, rerank_scheme=args.rerank_scheme,
            enable_runtime_lora=args.enable_runtime_lora, cpu_workers=args.cpu_workers, gc_freeze=args.gc_freeze,
            otlp_traces_endpoint=args.otlp_traces_endpoint, otlp_traces_protocol=args.otlp_traces_protocol)
    except ValueError as e:
        raise SystemExit(f"ferrox serve: {name_settings(str(e))}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's one configuration from the merged flags and variables."""
    from ferrox_jax.engine import DEFAULT_COMPILE_CACHE, EngineConfig

    cache = args.compile_cache_dir or os.path.expanduser(DEFAULT_COMPILE_CACHE)
    try:
        return EngineConfig(
            model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
            load_format=args.load_format, dummy_weights_seed=args.dummy_weights_seed, mmproj=args.mmproj,
            quantization=args.quantization, int8_kernel=args.int8_kernel, kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size, kv_blocks=args.kv_blocks, kv_memory_gib=args.kv_memory_gib,
            max_context=args.max_context, max_seqs=args.max_seqs, prefill_chunk=args.prefill_chunk,
            prefill_chunk_idle=args.prefill_chunk_idle, max_batched_tokens=args.max_batched_tokens,
            max_queue=args.max_queue, scheduling_policy=args.scheduling_policy, prefix_caching=args.prefix_caching,
            state_snapshots=args.state_snapshots, state_snapshot_interval=args.state_snapshot_interval,
            compile_cache_dir=None if cache == "off" else cache, executable_store=args.executable_store,
            executable_store_max_gib=args.executable_store_max_gib,
            tensor_parallel=args.tensor_parallel, mesh=args.mesh, replicate_attention=args.replicate_attention,
            expert_parallel=args.expert_parallel,
            attention_impl=args.attention_impl, coordinator_address=args.coordinator_address,
            num_processes=args.num_processes, process_id=args.process_id,
            multihost_timeout_s=args.multihost_timeout_s, multihost_secret=args.multihost_secret,
            share_compiles=args.share_compiles, max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank, lora_modules=_flat_pairs(args.lora_modules),
            speculative=speculative_config(args), step_timeout_s=args.step_timeout_s,
            max_step_faults=args.max_step_faults, grammar_sandbox=args.grammar_sandbox,
            grammar_workers=args.grammar_workers, grammar_timeout_s=args.grammar_timeout_s)
    except ValueError as e:
        raise SystemExit(f"ferrox serve: {name_settings(str(e))}") from None


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative ngram` with its flags, or `--speculative-config JSON`; None: off."""
    from ferrox_jax.engine import SpeculativeConfig

    flags = dict(num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                 ngram_max=args.ngram_max, max_rows=args.speculative_max_rows,
                 max_speculative_tokens=args.max_speculative_tokens)
    if args.draft_model:
        flags["draft_model"] = args.draft_model
    if args.speculative_config:
        return SpeculativeConfig.from_json(args.speculative_config, **flags)
    if args.speculative in (None, "", "off"):
        return None
    return SpeculativeConfig(method=args.speculative, **flags)


def _flat_pairs(value) -> tuple[tuple[str, str], ...]:
    """--lora-modules: the variable's pairs, or the flag's list of parsed words."""
    if value and isinstance(value, list):
        return tuple(pair for word in value for pair in word)
    return tuple(value or ())


# ---------------------------------------------------------------- serve


def load_engine(config: EngineConfig, url: str | None, default_grammar: Any = None,
                wrap_runner: Callable[[Any], Any] | None = None) -> Engine:
    """Load, warm up and start the engine, one log line per phase (a progress bar on stderr
    while it runs): loading the weights, compiling N step shapes, ready with the URL and
    the start-up block. `default_grammar` (the server-wide constraint) is compiled first:
    one the engine cannot enforce stops start-up with its reason."""
    from tqdm import tqdm

    from api import offload
    from ferrox_jax.engine import Engine, MemoryBoundError

    logger.info("loading weights: %s", config.model)
    with tqdm(desc="loading weights", unit="tensor", file=sys.stderr, leave=False) as bar:
        try:
            engine = Engine.load(config, progress=lambda _name: bar.update(1), wrap_runner=wrap_runner)
        except MemoryBoundError as e:  # a setting the devices cannot hold: name its flag and variable
            offload.resume_collector(freeze=False)
            raise ValueError(name_settings(str(e), e.field)) from None
        except BaseException:
            offload.resume_collector(freeze=False)
            raise
    # `serve` paused the collector before its imports (api/offload.py): on again, start-up's
    # heap frozen until the loader's `freeze_heap` collects it. Nothing when not paused.
    offload.resume_collector()
    logger.info("weights loaded: %d tensors in %.1f s", bar.n, engine.load_s)
    if default_grammar is not None:
        from ferrox_jax.constraint import GrammarError

        try:
            engine.check_grammar(default_grammar)
        except GrammarError as e:
            engine.shutdown()
            raise ValueError(f"the default output constraint (--grammar, --grammar-file or --json-schema): {e}") \
                from None
    shapes = engine.describe()["num_compiled_shapes"]
    # The longest phase of a cold start (minutes on a small CPU box): say what it is and how to make it short.
    logger.info("compiling %d step shapes (%s)", shapes, f"the compile cache {config.compile_cache_dir} makes the "
                "next start fast" if config.compile_cache_dir else "no compile cache: every start compiles them all")
    bar = tqdm(desc="compiling step shapes", total=shapes, unit="shape", file=sys.stderr, leave=False)

    def on_compile(done: int, total: int, _key: Any) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        engine.warmup(on_compile)
    finally:
        bar.close()
    logger.info("compiled %d step shapes in %.1f s", shapes, engine.warmup_s or 0)
    engine.start()
    info = engine.describe()
    lines = [f"  {key}: {value}" for key, value in info.items()]
    lines.append(f"  load: {engine.load_s:.1f} s, warm-up: {engine.warmup_s or 0:.1f} s")
    lines.append(f"  rss: {describe_rss(info['weights_bytes'], info['kv_bytes'])}")
    ready = "ready" if url is None else f"ready: serving {info['model']!r} at {url}/v1 (health: {url}/health)"
    logger.info("%s\n%s", ready, "\n".join(lines))  # url None: nothing listens (run-batch)
    return engine


def serve(args: argparse.Namespace, wrap_runner: Callable[[Any], Any] | None = None) -> int:
    from api import offload

    offload.pause_collector()  # from before the imports until the weights are placed (load_engine)
    try:
        from hypercorn.asyncio import serve as hypercorn_serve

        from api import multihost_app, process_knobs
        from api.app import create_app, drain, state_of

        config = server_config(args)
        engine_cfg = engine_config(args)
        follower = multihost_app.is_follower(engine_cfg)
        if not follower:
            hc = hypercorn_config(config)
            try:  # before the app and the model load: a port in use is one line, not a traceback later
                listener = process_knobs.bind_port(config, config.backlog)
            except OSError as e:
                raise SystemExit(f"ferrox serve: {process_knobs.listen_problem(config, e)}") from None
    except BaseException:
        offload.resume_collector(freeze=False)
        raise
    if follower:  # processes > 0 of a cluster: steps from process 0, /health only
        offload.resume_collector(freeze=False)
        return multihost_app.serve_follower(engine_cfg, config, wrap_runner)
    port = listener.getsockname()[1]
    url = process_knobs.url_of(config, port)
    hc.bind = [f"fd://{listener.fileno()}"]  # Hypercorn serves the socket already bound (api/process_knobs.py)
    app = create_app(lambda: load_engine(engine_cfg, url, config.default_grammar, wrap_runner), config,
                     engine_factory=lambda model: load_engine(
                         dataclasses.replace(engine_cfg, model=model, served_model_name=None), url,
                         config.default_grammar, wrap_runner))
    if multihost_app.is_multiprocess(engine_cfg):
        multihost_app.watch_group(app)
    logger.info("ferrox serve: listening on %s, loading %s", url, engine_cfg.model)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        exit_code = 0

        draining: list[asyncio.Task] = []  # at most one drain, however many signals arrive

        async def shutdown_on_signal() -> None:
            logger.info("draining (up to %.0f s)", config.shutdown_timeout_s)
            await drain(app, config.shutdown_timeout_s)
            stop.set()

        def on_signal() -> None:
            if not draining:
                draining.append(loop.create_task(shutdown_on_signal()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if args.exit_on_stdin_close:
            process_knobs.exit_on_stdin_close(loop, on_signal)
        process_knobs.print_event("listening", url, config.host, port)
        announcing = loop.create_task(process_knobs.announce_ready(state_of(app), url, config.host, port))

        async def trigger() -> None:
            nonlocal exit_code
            state = state_of(app)
            failed = asyncio.create_task(state.load_failed.wait())
            faulted = asyncio.create_task(state.engine_failed.wait())
            stopped = asyncio.create_task(stop.wait())
            done, pending = await asyncio.wait({failed, faulted, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if failed in done:
                exit_code = EXIT_LOAD_FAILED
            elif faulted in done:
                kind, reason = state.fatal
                exit_code = EXIT_ENGINE_HUNG if kind == "timeout" else EXIT_ENGINE_FAULTED
                logger.critical("the engine gave up (%s): %s; exiting %d for a supervisor to restart the server",
                                kind, reason, exit_code)

        await hypercorn_serve(app, hc, shutdown_trigger=trigger)
        announcing.cancel()
        return exit_code

    code = _run_loop(run())
    if multihost_app.is_multiprocess(engine_cfg):
        multihost_app.exit_now(code)
    if code in (EXIT_ENGINE_FAULTED, EXIT_ENGINE_HUNG):
        # The owner thread may be stuck inside a device call, which interpreter exit (jax's
        # atexit hooks) would wait on forever: leave now, logs flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def hypercorn_config(config: ServerConfig) -> Any:
    from hypercorn.config import Config

    hc = Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.loglevel = config.log_level.upper()
    hc.accesslog = None
    hc.graceful_timeout = 5.0  # the drain already waited; this only closes idle connections
    # Connection limits Hypercorn 0.18 has (it has no cap on open connections; the app's
    # max_concurrent_requests guard answers 503 instead, see api/guards.py).
    hc.backlog = config.backlog
    hc.h11_max_incomplete_size = config.max_header_bytes  # request line + headers (HTTP/1.1)
    hc.h2_max_header_list_size = config.max_header_bytes  # the same for HTTP/2 (TLS with ALPN)
    hc.keep_alive_timeout = config.keep_alive_timeout_s
    # No read_timeout: it would also close a client that reads a long stream and sends nothing.
    if config.tls_cert:
        hc.certfile, hc.keyfile = config.tls_cert, config.tls_key
    return hc


def _run_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # Windows, or not installed: the default loop works too
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------- run-batch


def run_batch(args: argparse.Namespace) -> int:
    """Answer an OpenAI Batch file with the server's own routes, in-process (api/batch.py)."""
    from api.app import create_app
    from api.batch import check_files, run_batch as answer_lines

    problem = check_files(args.input_file, args.output_file)  # before anything loads or is opened
    if problem is not None:
        print(f"ferrox run-batch: {problem}", file=sys.stderr)
        return EXIT_BAD_FILES
    # Nothing listens: the lines reach the routes through an in-process client, so the HTTP
    # settings that guard a socket (address, key, rate limit, the pages) do not apply.
    args.addr = args.host = args.port = args.api_key = None
    args.rate_limit_per_minute, args.web_ui = 0, False
    config = server_config(args)
    engine_cfg = engine_config(args)
    concurrency = args.max_concurrency or 2 * engine_cfg.max_seqs
    if concurrency < 1:
        raise SystemExit("ferrox run-batch: --max-concurrency must be >= 1")
    app = create_app(lambda: load_engine(engine_cfg, None, config.default_grammar), config)
    return _run_loop(answer_lines(app, args.input_file, args.output_file, concurrency,
                                  progress=not args.no_progress))


# ---------------------------------------------------------------- generate


def generate(args: argparse.Namespace) -> int:
    """Load the model, generate for one prompt and stream the text to stdout."""
    from ferrox_jax.engine import Engine, EngineConfig
    from ferrox_jax.request import Job, RowSampling

    try:
        config = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                              kv_memory_gib=args.kv_memory_gib)
    except ValueError as e:
        raise SystemExit(f"ferrox generate: {e}") from None
    try:
        engine = Engine.load(config)
    except (ValueError, OSError) as e:  # a checkpoint this engine cannot serve: its message names the file
        raise SystemExit(f"ferrox generate: {e}") from None
    engine.start()
    try:
        tok = engine.tokenizer
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(args.prompt)
        max_tokens = max(1, min(args.max_tokens, engine.max_context - len(ids)))
        events: queue.Queue = queue.Queue()
        req = Job(request_id="generate-0", prompt_token_ids=tuple(ids), max_tokens=max_tokens,
                  sampling=RowSampling(temperature=args.temperature, top_p=args.top_p,
                                       seed=args.seed))
        engine.submit(req, events.put)
        while True:
            ev = events.get()
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finish_reason is not None:
                sys.stdout.write("\n")
                if ev.finish_reason == "error":
                    print(f"ferrox generate: {ev.error}", file=sys.stderr)
                    return 1
                return 0
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
