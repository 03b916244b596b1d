"""The soak's hostile requests: what an attacker, or an operator having a bad day, sends.

tools/soak/soak.py mixes these (`--hostile-frac`) into its normal load. Each one is a request
the server must refuse with a 4xx in its route's own error envelope while everything else
keeps being served; none may change what the server is (asleep, its KV cache, its adapters):
the soak checks that at the end (`state_of` before and after).

The kinds, each drawn with equal weight (the ones that need `--enable-runtime-lora` or
prepared adapter folders only when the server has them):

- `rebuild_huge`: `/v1/cache/rebuild` asking for a cache no device holds (2**62 blocks, 1e12
  GiB, 2**40 blocks, 1e9 GiB): a 400 before any allocation;
- `cross_origin_sleep`, `cross_origin_rebuild`: a page of another origin posting a
  "simple" request (`mode: "no-cors"`: `Content-Type: text/plain`, an `Origin` of its own)
  to a state-changing route; `blob_no_type`: the same with no Content-Type at all (a
  `Blob` body);
- `text_plain_json`: a generation body sent as `text/plain` (415: JSON routes take JSON);
- `bad_host`: a read route asked under a foreign `Host` (DNS rebinding): 421;
- `lora_surrogate`: loading an adapter whose name is a lone surrogate;
- `lora_bad_file`: loading one of the prepared broken adapters (`make_bad_adapters`: NaN and
  1e30 weights, bad JSON, `r: 0`, a string alpha, garbage safetensors);
- `choices_bomb`: `guided_choice` with more choices than the parser can hold;
- `schema_bomb`: a `json_schema` with hundreds of optional properties;
- `reply_bomb`: one small completions body that would build a reply of tens of MiB
  (prompts x max_tokens x logprobs);
- `session_bloat`: a chat turn under a `session_id` whose message carries a 1 MiB field the
  template never renders. It may be served (200) or refused (4xx); what it must not do is
  grow the process: the soak's RSS figure covers it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import sys
from pathlib import Path
from typing import Any

KINDS = ("rebuild_huge", "cross_origin_sleep", "cross_origin_rebuild", "blob_no_type", "text_plain_json",
         "bad_host", "lora_surrogate", "lora_bad_file", "choices_bomb", "schema_bomb", "reply_bomb",
         "session_bloat")
LORA_KINDS = ("lora_surrogate", "lora_bad_file")
EVIL_ORIGIN = "https://attacker.example"
HUGE_REBUILDS = ({"kv_blocks": 4611686018427387904}, {"kv_memory_gib": 1e12}, {"kv_blocks": 2 ** 40},
                 {"kv_memory_gib": 1e9})
BAD_ADAPTERS = ("nan_weights", "huge_weights", "bad_json", "list_json", "rank_zero", "string_alpha",
                "garbage_safetensors", "huge_header_safetensors")
SESSION_FIELD_BYTES = 1 << 20
NUM_SESSIONS = 8  # bloated sessions reuse a few ids, as one misbehaving client would


@dataclasses.dataclass(frozen=True)
class HostileCall:
    """One hostile request, and what it must get."""

    kind: str
    method: str
    path: str
    content: bytes
    headers: dict[str, str]
    may_succeed: bool = False  # session_bloat: served or refused, never a 5xx

    @property
    def envelope(self) -> str:
        if self.path == "/v1/messages" or self.path.startswith("/v1/messages/"):
            return "anthropic"
        if self.path in ("/completion", "/completions", "/slots"):
            return "llamacpp"
        return "openai"


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


JSON = {"Content-Type": "application/json"}


def hostile_call(rng: random.Random, model: str, bad_adapters: tuple[str, ...] = (),
                 runtime_lora: bool = False) -> HostileCall:
    """A random hostile request (seeded by `rng`); `bad_adapters` are folder names under the
    server's --model-dir made by `make_bad_adapters`."""
    kinds = [k for k in KINDS if k not in LORA_KINDS or runtime_lora]
    if not bad_adapters and "lora_bad_file" in kinds:
        kinds.remove("lora_bad_file")
    kind = rng.choice(kinds)
    simple = {"Content-Type": "text/plain;charset=UTF-8", "Origin": EVIL_ORIGIN, "Sec-Fetch-Site": "cross-site",
              "Sec-Fetch-Mode": "no-cors"}
    if kind == "rebuild_huge":
        return HostileCall(kind, "POST", "/v1/cache/rebuild", _json(rng.choice(HUGE_REBUILDS)), JSON)
    if kind == "cross_origin_sleep":
        return HostileCall(kind, "POST", "/sleep?level=1", b"", simple)
    if kind == "cross_origin_rebuild":
        return HostileCall(kind, "POST", "/v1/cache/rebuild", _json({"kv_blocks": 64}), simple)
    if kind == "blob_no_type":
        headers = {"Origin": EVIL_ORIGIN, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
        return HostileCall(kind, "POST", "/sleep?level=1", _json({}), headers)
    if kind == "text_plain_json":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return HostileCall(kind, "POST", "/v1/chat/completions", _json(body), {"Content-Type": "text/plain"})
    if kind == "bad_host":
        path = rng.choice(["/v1/models", "/admin/stats", "/slots", "/v1/cache/status"])
        return HostileCall(kind, "GET", path, b"", {"Host": "attacker.example"})
    if kind == "lora_surrogate":
        raw = b'{"lora_name": "a\\ud800b", "lora_path": "x"}'
        return HostileCall(kind, "POST", "/v1/load_lora_adapter", raw, JSON)
    if kind == "lora_bad_file":
        name = rng.choice(bad_adapters)
        body = {"lora_name": f"bad-{name}-{rng.randrange(1 << 30)}", "lora_path": name}
        return HostileCall(kind, "POST", "/v1/load_lora_adapter", _json(body), JSON)
    if kind == "choices_bomb":
        choices = [f"choice number {i}" for i in range(rng.choice([2_001, 4_096, 20_000]))]
        body = {"model": model, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 4,
                "guided_choice": choices}
        return HostileCall(kind, "POST", "/v1/chat/completions", _json(body), JSON)
    if kind == "schema_bomb":
        properties = {f"p{i}": {"type": "string"} for i in range(rng.choice([499, 1_000]))}
        schema = {"type": "object", "properties": properties}  # open: 498 optional properties is what runs
        body = {"model": model, "messages": [{"role": "user", "content": "fill"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
        return HostileCall(kind, "POST", "/v1/chat/completions", _json(body), JSON)
    if kind == "reply_bomb":
        body = {"model": model, "prompt": ["a"] * 500, "max_tokens": 400, "logprobs": 20, "ignore_eos": True}
        return HostileCall(kind, "POST", "/v1/completions", _json(body), JSON)
    # session_bloat
    message = {"role": "user", "content": "hello", "name": "n" * SESSION_FIELD_BYTES}
    body = {"model": model, "messages": [message], "max_tokens": 1,
            "session_id": f"soak-bloat-{rng.randrange(NUM_SESSIONS)}"}
    return HostileCall(kind, "POST", "/v1/chat/completions", _json(body), JSON, may_succeed=True)


def make_bad_adapters(good: Path, out: Path) -> tuple[str, ...]:
    """Write broken copies of the PEFT adapter folder `good` under `out`; returns their names.

    Each is broken in one way a loader must refuse with a 400: non-finite or absurd weights,
    an unreadable or wrong-typed adapter_config.json, rank 0, a string alpha, a safetensors
    file that is garbage or declares a header larger than the file."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    config = json.loads((good / "adapter_config.json").read_text())
    weights = load_file(str(good / "adapter_model.safetensors"))
    for name in BAD_ADAPTERS:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        cfg, tensors, raw = dict(config), dict(weights), None
        if name == "nan_weights":
            key = sorted(tensors)[0]
            tensors[key] = np.full_like(tensors[key], np.nan)
        elif name == "huge_weights":
            tensors = {k: np.full_like(v, 1e30) for k, v in tensors.items()}
        elif name == "rank_zero":
            cfg["r"] = 0
        elif name == "string_alpha":
            cfg["lora_alpha"] = "sixteen"
        elif name == "garbage_safetensors":
            raw = b"\x00garbage" * 64
        elif name == "huge_header_safetensors":
            raw = struct.pack("<Q", 1 << 40) + b"{}"
        if name == "bad_json":
            (folder / "adapter_config.json").write_text("{not json")
        elif name == "list_json":
            (folder / "adapter_config.json").write_text("[1, 2]")
        else:
            (folder / "adapter_config.json").write_text(json.dumps(cfg))
        if raw is not None:
            (folder / "adapter_model.safetensors").write_bytes(raw)
        else:
            save_file(tensors, str(folder / "adapter_model.safetensors"))
    return BAD_ADAPTERS


async def state_of(client: Any) -> dict[str, Any]:
    """What a hostile request must not change: asleep or not, the cache's size, the adapters."""
    sleeping = await client.get("/is_sleeping")
    stats = await client.get("/admin/stats")
    models = await client.get("/v1/models")
    return {"is_sleeping": sleeping.json().get("is_sleeping") if sleeping.status_code == 200 else sleeping.status_code,
            "kv_blocks_total": stats.json().get("kv_blocks_total") if stats.status_code == 200 else stats.status_code,
            "models": sorted(m["id"] for m in models.json()["data"]) if models.status_code == 200
            else models.status_code}


if __name__ == "__main__":  # python -m tools.soak.soak_hostile GOOD_ADAPTER_DIR MODEL_DIR
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tools.soak.soak_hostile GOOD_ADAPTER_DIR MODEL_DIR: writes MODEL_DIR/soak-bad/* and "
                 "prints the --bad-adapters value")
    names = make_bad_adapters(Path(sys.argv[1]), Path(sys.argv[2]) / "soak-bad")
    print(",".join(f"soak-bad/{name}" for name in names))
