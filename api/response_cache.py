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
- Bounded by entries and bytes, the least recently used entry making room. The bytes are
  what the recorded objects take in memory, counted object by object (`_entry_bytes`:
  every logprob alternative is a tuple, an int and a float, ~108 bytes), not their text:
  an entry of logprobs, echo and n 4 holds ~20x its text and token ids. A model swap or unload clears it (`AppState.on_engine_change`),
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
import sys
from typing import TYPE_CHECKING, Any, Sequence

from quart.wrappers.response import DataBody

from ferrox_jax.request import RowEvent, RowResult

if TYPE_CHECKING:
    from api.generation import GenerationRun, RowOutput

# What the objects of an entry take in this process, measured once from samples
# (`sys.getsizeof`; an instance's attributes as the dict they become when it is copied or
# pickled, a little above the inline values a fresh one holds). Token ids and logprobs
# are Python ints and floats of their own (the engine converts its arrays with tolist()),
# so every logprob alternative is a 2-tuple, an int and a float.
_INT_BYTES = sys.getsizeof(1 << 20)  # a token id past the small-int cache
_FLOAT_BYTES = sys.getsizeof(0.5)
_PAIR_BYTES = sys.getsizeof((0, 0.5)) + _INT_BYTES + _FLOAT_BYTES  # (token id, logprob)


def _instance_bytes(cls: type, **fields: Any) -> int:
    sample = cls(**fields)
    return sys.getsizeof(sample) + sys.getsizeof(vars(sample))


_RESULT_BYTES = _instance_bytes(RowResult, row_id=0, token_id=0) + _INT_BYTES + _FLOAT_BYTES
_EVENT_BYTES = _instance_bytes(RowEvent, request_id="", index=0, token_ids=(), text="", logprobs=None,
                               finish_reason=None) + 2 * _INT_BYTES + _FLOAT_BYTES  # counts, queue_s
# The entry's own record: its 64-character key, the (outputs, bytes) pair, its slot in the cache.
_ENTRY_BYTES = sys.getsizeof("0" * 64) + sys.getsizeof((None, 0)) + _INT_BYTES + 100


def _result_bytes(result: RowResult | None) -> int:
    """One token's result: the object, its id and logprob, and its alternatives."""
    if result is None:
        return 0
    size = _RESULT_BYTES + sys.getsizeof(result.top_logprobs) + _PAIR_BYTES * len(result.top_logprobs)
    return size + sum(_result_bytes(r) for r in result.following)


def _entry_bytes(outputs: Sequence[RowOutput]) -> int:
    """What an entry holds, counted object by object (the sizes above): each output and its
    event, the event's text and token ids, its logprob results with their alternatives, and
    its prompt logprobs, whose items a job's choices share (counted once). Checked against
    what tracemalloc sees a copy of a logprob-heavy entry take (tests/server/test_api_response_cache.py);
    counting the text and 8 bytes per token id alone under-counted such entries 15-24x."""
    if not outputs:
        return _ENTRY_BYTES
    output_bytes = _instance_bytes(type(outputs[0]), choice=0, job=0, event=None)  # RowOutput, not imported
    size = _ENTRY_BYTES + sys.getsizeof(()) + 8 * len(outputs)  # the tuple the entry keeps
    seen_prompt_items: set[int] = set()
    request_ids: set[int] = set()
    for output in outputs:
        event = output.event
        size += output_bytes + _EVENT_BYTES
        size += sys.getsizeof(event.text) + sys.getsizeof(event.token_ids) + _INT_BYTES * len(event.token_ids)
        if id(event.request_id) not in request_ids:  # one string per job, shared by its events
            request_ids.add(id(event.request_id))
            size += sys.getsizeof(event.request_id)
        for text in (event.error, event.stop_string):
            size += sys.getsizeof(text) if text is not None else 0
        if event.logprobs is not None:
            size += sys.getsizeof(event.logprobs) + sum(_result_bytes(r) for r in event.logprobs)
        size += _result_bytes(event.stop_token)
        if event.prompt_logprobs is not None:
            size += sys.getsizeof(event.prompt_logprobs)
            for item in event.prompt_logprobs:  # (logprob, alternatives): the same objects in every choice
                if id(item) not in seen_prompt_items:
                    seen_prompt_items.add(id(item))
                    top = item[1]
                    size += sys.getsizeof(item) + _FLOAT_BYTES + sys.getsizeof(top) + _PAIR_BYTES * len(top)
    return size


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
        # The adapter's name and key (its weights' version) stay in (the engine picks its slot).
        parts.append(repr(dataclasses.replace(job, request_id="", sampling=sampling)))
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
