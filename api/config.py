"""`ServerConfig`: the HTTP side of `ferrox serve`'s settings, validated once.

`api/settings.py` holds the table of every setting (flag, FERROX_* variable, default) and is
the only module that reads the environment; `api/cli.py` fills this dataclass (and the
engine's `EngineConfig`, `ferrox_jax/config.py`) from the merged values. Each check here
names its field. Byte caps on what the server keeps (request bodies, resumable streams,
the response cache) must fit in the host's memory (`host_total_bytes`, which the engine
facade exports from `ferrox_jax/memory_bounds.py`): a cap the host cannot hold caps nothing.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.request import MAX_LOGPROBS

DEFAULT_HOST = "127.0.0.1"
_HOST_NAME = re.compile(r"^\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?$")  # an --allowed-hosts entry
DEFAULT_PORT = 8383
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings; validated once, field names in the messages."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None  # Bearer key for every route but /health and /metrics
    max_body_bytes: int = 4 * MIB  # larger bodies get 413
    max_n: int = 16  # choices per request (each is a row holding its own blocks)
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_images: int = 8  # images per request
    max_image_bytes: int = 20 * MIB  # one image file
    max_image_pixels: int = 40_000_000  # one image's width x height (checked from its header)
    # Hosts, .domains, addresses and networks image URLs may be fetched from (api/image_fetch.py);
    # empty: image URLs are refused, only inline images are taken.
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 10.0  # one image URL's whole fetch, redirects included (400 above)
    max_prompt_tokens: int = 0  # tokens per prompt; 0 = the context ceiling (400 above)
    max_output_tokens: int = 0  # max_tokens a request may ask; 0 = the room left in the context
    max_logprobs: int = MAX_LOGPROBS  # logprobs (completions) / top_logprobs (chat)
    # Token entries one reply may hold: prompts x n x max_tokens x (1 + logprobs) (api/limits.py).
    max_reply_entries: int = 1 << 20
    max_concurrent_requests: int = 1024  # open HTTP requests (probes excluded); 503 above
    max_header_bytes: int = 64 * 1024  # request line + headers (Hypercorn h11_max_incomplete_size)
    backlog: int = 128  # listen queue of not-yet-accepted connections
    keep_alive_timeout_s: float = 5.0  # idle keep-alive connections are closed after this
    request_timeout_s: float = 600.0  # non-streaming generations: 504 and cancelled after this
    sse_orphan_timeout_ms: int = 30_000  # a stream whose client reads nothing this long is cancelled
    sse_keepalive_s: float = 15.0  # idle streams get a ": keep-alive" comment this often
    cors_origins: tuple[str, ...] = ()  # exact origins; never "*"
    # Host names the server answers to besides localhost, the bound address and IP literals
    # (421 for others; api/same_origin.py). Empty: none on a loopback bind, any otherwise.
    allowed_hosts: tuple[str, ...] = ()
    rate_limit_per_minute: int = 0  # per client address; 0 = off
    auth_failures_per_minute: int = 20  # wrong keys per client address; 429 above, before the key check (0 = off)
    body_read_timeout_s: float = 10.0  # a body must arrive within this plus 1 s per 64 KiB (408 above)
    allow_unauthenticated_remote: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    shutdown_timeout_s: float = 30.0  # graceful drain on SIGTERM/SIGINT
    log_level: str = "info"
    # The output constraint of every generation request that gives none
    # (--grammar / --grammar-file / --json-schema; docs/structured-output.md).
    default_grammar: GrammarSpec | None = None
    model_dir: str | None = None  # local checkpoints /admin/models lists and loads (nothing is downloaded)
    resumable_max_bytes: int = MIB  # events one resumable stream keeps for replay (oldest dropped first)
    resumable_ttl_s: float = 300.0  # a finished resumable stream is kept this long
    resumable_max_streams: int = 256  # resumable streams kept at once
    web_ui: bool = True  # the chat page at / and the dashboard at /dashboard (api/web/)
    session_max: int = 1024  # chat sessions (`session_id`) kept at once; the least recently used makes room
    session_ttl_s: float = 3600.0  # a session unused this long is forgotten
    session_max_bytes: int = MIB  # one session's kept turns; its oldest exchanges make room (api/sessions.py)
    session_max_total_bytes: int = 64 * MIB  # every session's turns together; the least recently used go
    response_cache: bool = False  # answer repeated deterministic requests from memory (api/response_cache.py)
    response_cache_max_entries: int = 1024
    response_cache_max_bytes: int = 64 * MIB
    rerank_scheme: str = "auto"  # /v1/rerank, /v1/score: auto, yes-no or embedding (api/rerank_routes.py)
    enable_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    cpu_workers: int = 2  # threads CPU-heavy request steps run on, off the event loop (api/offload.py)
    gc_freeze: bool = True  # the loaded engine's objects out of full garbage collections (api/offload.py)
    # OpenTelemetry traces (api/tracing.py): the OTLP collector; None: tracing off, no SDK imported.
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "http/protobuf"  # or "grpc"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in 0..65535 (0: a free port); got {self.port}")
        for name in ("max_body_bytes", "max_n", "max_stop_strings", "max_stop_chars", "max_reply_entries",
                     "max_images", "max_image_bytes", "max_image_pixels",
                     "max_concurrent_requests",
                     "max_header_bytes", "backlog", "sse_orphan_timeout_ms", "resumable_max_bytes",
                     "resumable_max_streams", "session_max", "session_max_bytes", "session_max_total_bytes",
                     "response_cache_max_entries", "response_cache_max_bytes", "cpu_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1; got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"ServerConfig.{name} must be >= 0 (0 = the context ceiling); "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"ServerConfig.max_logprobs must be in [0, {MAX_LOGPROBS}] (the engine's limit); "
                             f"got {self.max_logprobs}")
        for name in ("request_timeout_s", "keep_alive_timeout_s", "resumable_ttl_s", "session_ttl_s",
                     "media_fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0; got {getattr(self, name)}")
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"ServerConfig.sse_keepalive_s must be > 0; got {self.sse_keepalive_s}")
        if self.rate_limit_per_minute < 0:
            raise ValueError(f"ServerConfig.rate_limit_per_minute must be >= 0; got {self.rate_limit_per_minute}")
        if self.auth_failures_per_minute < 0:
            raise ValueError(f"ServerConfig.auth_failures_per_minute must be >= 0; got {self.auth_failures_per_minute}")
        if not self.body_read_timeout_s > 0:
            raise ValueError(f"ServerConfig.body_read_timeout_s must be > 0; got {self.body_read_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"ServerConfig.shutdown_timeout_s must be >= 0; got {self.shutdown_timeout_s}")
        for origin in self.cors_origins:
            if origin == "*" or "://" not in origin:
                raise ValueError("ServerConfig.cors_origins must be exact origins like "
                                 f"'https://app.example.com' (never '*'); got {origin!r}")
        for name in self.allowed_hosts:
            if not (name == "*" or _HOST_NAME.match(name)):
                raise ValueError("ServerConfig.allowed_hosts must be host names without scheme or port, "
                                 "'.example.com' for a domain and its subdomains, or '*' (IP addresses need "
                                 f"no entry); got {name!r}")
        from api.image_fetch import check_entries

        check_entries(self.allowed_media_domains)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("ServerConfig.tls_cert and tls_key must be given together")
        if self.session_max_bytes > self.session_max_total_bytes:
            raise ValueError(f"ServerConfig.session_max_bytes ({self.session_max_bytes}) must not exceed "
                             f"session_max_total_bytes ({self.session_max_total_bytes})")
        if self.rerank_scheme not in ("auto", "yes-no", "embedding"):
            raise ValueError(f"ServerConfig.rerank_scheme must be auto, yes-no or embedding; got {self.rerank_scheme!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key must not be empty (leave it unset for no key)")
        self._check_byte_caps()
        self._check_tracing()
        if not self.api_key and not self.allow_unauthenticated_remote and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on non-loopback address {self.host!r} without an API key; "
                "set --api-key / FERROX_API_KEY, or --allow-unauthenticated-remote "
                "(FERROX_ALLOW_UNAUTHENTICATED_REMOTE=1) to accept that risk")

    def _check_tracing(self) -> None:
        """The OTLP settings; with an endpoint, the SDK must be importable now, not at the first request."""
        from api.tracing import PROTOCOLS, check_available  # imports nothing of OpenTelemetry itself

        if self.otlp_traces_protocol not in PROTOCOLS:
            raise ValueError(f"ServerConfig.otlp_traces_protocol must be one of {', '.join(PROTOCOLS)}; "
                             f"got {self.otlp_traces_protocol!r}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is None:
            return
        if self.otlp_traces_protocol == "http/protobuf" and not endpoint.startswith(("http://", "https://")):
            raise ValueError("ServerConfig.otlp_traces_endpoint must be an http:// or https:// URL with "
                             f"otlp_traces_protocol http/protobuf; got {endpoint!r}")
        if not endpoint.strip():
            raise ValueError("ServerConfig.otlp_traces_endpoint must not be empty (leave it unset for no tracing)")
        check_available(self.otlp_traces_protocol)

    def _check_byte_caps(self) -> None:
        """Caps on bytes the server holds, against the host's memory."""
        from ferrox_jax.engine import host_total_bytes  # the facade's module imports jax: not at `--help`

        host = host_total_bytes()
        if host is None:
            return
        for what, cap in (("max_body_bytes", self.max_body_bytes),
                          ("resumable_max_bytes x ServerConfig.resumable_max_streams",
                           self.resumable_max_bytes * self.resumable_max_streams),
                          ("response_cache_max_bytes", self.response_cache_max_bytes)):
            if cap > host:
                raise ValueError(f"ServerConfig.{what} ({cap / 2**30:,.1f} GiB) must fit in this host's memory "
                                 f"({host / 2**30:,.1f} GiB): a cap the host cannot hold caps nothing")

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


def is_loopback(host: str | None) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1 literals; no DNS lookup."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
