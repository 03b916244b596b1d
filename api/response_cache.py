"""The whole-response cache: a repeated deterministic request answered without the engine.

A request is *cacheable* when every job of it is deterministic: greedy (temperature 0) or
seeded by the client (`GenerationRun.seeded`: the request named its `seed`), and not a
pooling job. Its key is a SHA-256 over the served engine (model name and checkpoint) and
every engine job with its request id blanked: the prompt's token ids, the sampling
settings, the limits, stops and output constraint, the LoRA adapter's name and key (the
key changes when an adapter is reloaded with other weights; the slot it sits in does not
count), and whatever else a job carries. The lookup runs after the adapter is resolved. Two requests with equal keys are given the same tokens
by the engine, so the second is answered from the first's recorded row events.

- A hit replays the recorded `RowOutput`s through the same `GenerationRun` path a miss
  takes, so the adapter renders the same body, or the same stream of events, as it would
  have; nothing reaches the engine (no blocks, no row, no step).
- Only runs that finished normally are stored (every row `stop` or `length`): a cancelled,
  failed or timed-out run is not.
- Bounded by entries and bytes (the rows' text and token ids, roughly), the least recently
  used entry making room. A model swap or unload clears it (`AppState.on_engine_change`),
  and the key names the engine's model besides, so one model's answer never serves another's.
- Off unless `--response-cache`; `ferrox_cache` says what happened to each generation
  request: `hit`, `miss` (cacheable, computed, then stored), or `skip` (not cacheable, or
  the cache is off): the `ferrox-cache` response header, and a `ferrox_cache` field in a
  whole JSON reply. `/metrics` has `ferrox_cache_hits_total`, `ferrox_cache_misses_total`,
  `ferrox_cache_skips_total` and `ferrox_cache_entries`; `/cache/stats` the same as JSON.

Event-loop only.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, Sequence

from quart.wrappers.response import DataBody


if TYPE_CHECKING:
    from api.generation import GenerationRun, RowOutput


def _entry_bytes(outputs: Sequence[RowOutput]) -> int:
    """What an entry costs, counted from its events: text bytes and 8 per token id, plus a
    fixed 256 per event for the rest of its fields."""
    return sum(256 + len(o.event.text.encode("utf-8")) + 8 * len(o.event.token_ids) for o in outputs)


def is_deterministic(run: GenerationRun) -> bool:
    return all(job.pooling is None and (job.sampling.temperature == 0.0 or run.seeded) for job in run.jobs)


def run_key(run: GenerationRun) -> str:
    """The cache key of a run's jobs on its engine (see the module docstring)."""
    engine = run.engine
    parts = [repr((engine.model_name, engine.checkpoint_path, run.drop_output))]
    for job in run.jobs:
        sampling = job.sampling
        if sampling.temperature == 0.0:  # greedy: the seed (random unless given) changes nothing
            sampling = dataclasses.replace(sampling, seed=0)
        # The adapter's name and key (its weights' version) stay in; its slot is placement only.
        placement = {"adapter_slot": 0} if hasattr(job, "adapter_slot") else {}
        parts.append(repr(dataclasses.replace(job, request_id="", sampling=sampling, **placement)))
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


class ResponseCache:
    """Recorded row events of finished deterministic runs, bounded (see the module docstring)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[str, tuple[tuple[RowOutput, ...], int]] = collections.OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = self.skips = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, run: GenerationRun) -> tuple[str, str | None, tuple[RowOutput, ...] | None]:
        """("hit" | "miss" | "skip", the key to store under (miss only), the recorded outputs (hit only))."""
        if not is_deterministic(run):
            self.skips += 1
            return "skip", None, None
        key = run_key(run)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return "miss", key, None
        self._entries.move_to_end(key)
        self.hits += 1
        return "hit", None, entry[0]

    def store(self, key: str, outputs: Sequence[RowOutput]) -> None:
        size = _entry_bytes(outputs)
        if size > self.max_bytes:
            return
        if key in self._entries:
            self.num_bytes -= self._entries.pop(key)[1]
        self._entries[key] = (tuple(outputs), size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def stats(self) -> dict[str, Any]:
        return {"enabled": True, "entries": len(self._entries), "bytes": self.num_bytes,
                "max_entries": self.max_entries, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "skips": self.skips}


class ResponseCacheCollector:
    """The cache's counters for `/metrics` (registered on the app's registry by create_app)."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = self.cache
        yield CounterMetricFamily("ferrox_cache_hits", "generation requests answered from the response cache",
                                  value=cache.hits)
        yield CounterMetricFamily("ferrox_cache_misses", "cacheable generation requests computed and stored",
                                  value=cache.misses)
        yield CounterMetricFamily("ferrox_cache_skips", "generation requests the response cache cannot serve "
                                                        "(sampled without a seed)", value=cache.skips)
        yield GaugeMetricFamily("ferrox_cache_entries", "responses held in the response cache", value=len(cache))
        yield GaugeMetricFamily("ferrox_cache_bytes", "bytes the response cache's entries take (estimated)",
                                value=cache.num_bytes)


async def mark_response(response: Any, status: str | None) -> None:
    """The `ferrox-cache` header on a generation reply, and `ferrox_cache` in a whole JSON body.

    The field is spliced in before the body's closing brace rather than by parsing and
    serializing the body again: that took the event loop as long as building it did
    (seconds for a reply of a million logprob entries)."""
    if status is None:
        return
    response.headers["ferrox-cache"] = status
    if response.status_code != 200 or response.mimetype != "application/json" \
            or not isinstance(response.response, DataBody):  # a stream's body is not touched
        return
    body = (await response.get_data()).rstrip()
    if not body.startswith(b"{") or not body.endswith(b"}"):
        return  # not an object: nothing to add the field to
    separator = b"" if body[:-1].rstrip() == b"{" else b","
    response.set_data(body[:-1] + separator + f'"ferrox_cache":{json.dumps(status)}}}'.encode())
