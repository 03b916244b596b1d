"""`LLM`: the offline API (vLLM's `LLM`), the serving engine in-process with no HTTP in between.

    from ferrox_jax import LLM, SamplingParams

    llm = LLM(model="default", max_seqs=16)
    outputs = llm.generate(["The capital of France is", "1 + 1 ="],
                           SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)
    replies = llm.chat([{"role": "user", "content": "Say hello"}], SamplingParams(max_tokens=32))

It loads, warms up and starts the same `Engine` that `ferrox serve` runs (`Engine.load`,
`warmup`, `start`, `submit` with an event callback, `shutdown`: only the facade's public
methods), so a list of prompts gets continuous batching, chunked prefill, the prefix
cache and structured output exactly as concurrent HTTP requests do. Keyword settings are
`EngineConfig`'s fields (`ferrox_jax/config.py`: `dtype`, `kv_memory_gib`, `max_seqs`,
`quantization`, ...) or their vLLM names (`max_model_len`, `max_num_seqs`,
`tensor_parallel_size`, `enable_prefix_caching`). `quantization` defaults to `auto`, as
`ferrox serve`'s does (the default model runs on its GGUF blocks), not to EngineConfig's `none`.

Same prompt, same tokens as the server: `generate` encodes a text prompt as
`/v1/completions` does (with the tokenizer's special tokens) and `chat` renders messages
with the checkpoint's chat template and encodes them as `/v1/chat/completions` does; the
sampling settings map onto the engine's as the server maps a request's
(`ferrox_jax/offline.py`). With the same seed (or greedy) the outputs equal the server's
for the same settings (tests/server/test_offline_llm.py checks both).

Prompts are submitted as fast as the engine's waiting queue takes them; a progress bar
(`use_tqdm`) counts finished prompts with the prompt and output tokens/s so far. Results
come back in prompt order. An interrupt (Ctrl-C) or an error cancels every prompt still
open, so the engine's KV blocks return before the exception propagates.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import sys
import time
from typing import Any, Iterable, Sequence

from ferrox_jax.config import DEFAULT_COMPILE_CACHE, EngineConfig
from ferrox_jax.images import ImageLimits, image_file_bytes
from ferrox_jax.offline import CompletionOutput, RequestOutput, SamplingParams, logprob_dict, to_job
from ferrox_jax.priority import check_priority
from ferrox_jax.request import AdmissionError, Job, RowEvent

# vLLM's engine-argument names -> EngineConfig's.
VLLM_ENGINE_ARGS = {"max_model_len": "max_context", "max_num_seqs": "max_seqs",
                    "tensor_parallel_size": "tensor_parallel", "enable_prefix_caching": "prefix_caching"}
HEALTH_POLL_S = 5.0  # waiting for events re-checks that the engine is alive this often


SERVE_QUANTIZATION = "auto"  # api/settings.py's FERROX_QUANTIZATION default


def engine_config(model: str, **settings: Any) -> EngineConfig:
    """`EngineConfig` from `LLM`'s keyword settings (EngineConfig names or vLLM's).

    Raises:
      TypeError: a setting neither names.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    resolved: dict[str, Any] = {}
    for name, value in settings.items():
        key = VLLM_ENGINE_ARGS.get(name, name)
        if key not in fields:
            raise TypeError(f"LLM got an unknown engine setting {name!r}; EngineConfig takes "
                            f"{', '.join(sorted(fields - {'model'}))} (or vLLM's {', '.join(VLLM_ENGINE_ARGS)})")
        resolved[key] = value
    # `ferrox serve`'s default, not EngineConfig's "none": a quantized GGUF runs on its own
    # blocks (float32 accuracy at a sixth of the weight bytes), everything else unquantized.
    resolved.setdefault("quantization", SERVE_QUANTIZATION)
    return EngineConfig(model=model, **resolved)


class LLM:
    """An engine in this process, driven by lists of prompts (see the module docstring)."""

    def __init__(self, model: str = "default", **engine_settings: Any) -> None:
        """Load, warm up and start an engine for `model` (an HF folder, a .gguf file or
        "default"). The JAX compilation cache is `ferrox serve`'s (~/.cache/ferrox_jax/jax)
        unless `compile_cache_dir` or JAX's own setting says otherwise.

        Raises:
          TypeError (an unknown setting), ValueError (a setting the checkpoint or devices
          cannot serve), FileNotFoundError, and the loader's errors.
        """
        import jax

        from ferrox_jax.engine import Engine

        if "compile_cache_dir" not in engine_settings and not jax.config.jax_compilation_cache_dir:
            engine_settings["compile_cache_dir"] = os.path.expanduser(DEFAULT_COMPILE_CACHE)
        config = engine_config(model, **engine_settings)
        engine = Engine.load(config)
        try:
            _warm_up(engine)
            engine.start()
        except BaseException:
            engine.shutdown()
            raise
        self._init(engine, owned=True)

    @classmethod
    def from_engine(cls, engine: Any) -> "LLM":
        """Drive an engine that is already warmed up and started (the caller keeps owning it:
        `shutdown` leaves it running)."""
        llm = cls.__new__(cls)
        llm._init(engine, owned=False)
        return llm

    def _init(self, engine: Any, owned: bool) -> None:
        self._engine = engine
        self._owned = owned
        self._ids = itertools.count()

    # -- what it serves -------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The engine facade (`ferrox_jax/engine.py`): stats, model card, health."""
        return self._engine

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    # -- generation ----------------------------------------------------------------------

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt, as `/v1/completions` would.

        Args:
          prompts: a text, or `{"prompt": text}` / `{"prompt_token_ids": [ids]}` (vLLM's
            TextPrompt / TokensPrompt), or a list of them. For a model taking images,
            `{"prompt": text, "multi_modal_data": {"image": image or [images]}}` (PIL images,
            uint8 HxWx3 arrays or file bytes), the text holding the model's image marker
            (Gemma 3: `<start_of_image>`) where each image goes, as vLLM takes them.
          sampling_params: one for every prompt, or one per prompt (default: SamplingParams()).
          use_tqdm: show a progress bar on stderr.
          priority: one per prompt, lower first (vLLM's; needs `scheduling_policy="priority"`,
            else only zeros); default all 0.
        Returns:
          one RequestOutput per prompt, in order.
        """
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        tok = self._engine.tokenizer
        encoded = []
        for item in items:
            images = _multi_modal_images(item)
            if images:
                pictures = self._engine.prepare_images(images, ImageLimits())
                text = self._engine.expand_images(item["prompt"], pictures)
                ids = tok.encode(text)
                encoded.append((item["prompt"], ids, self._engine.image_spans(ids, pictures)))
            else:
                encoded.append((*_prompt_text_and_ids(item, tok), ()))
        return self._run(encoded, _per_prompt(sampling_params, len(encoded)), use_tqdm, priority)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, as `/v1/chat/completions` would.

        Args:
          messages: `[{"role", "content"}, ...]` (content a string or a list of text parts),
            or a list of such conversations.
          sampling_params: one for every conversation, or one each.
          add_generation_prompt: end the prompt with the assistant turn's opening.
          priority: one per conversation, as `generate`'s.
        Returns:
          one RequestOutput per conversation; `prompt` is the rendered template text.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self._engine.tokenizer
        encoded = []
        for conversation in conversations:
            text = tok.apply_chat_template([_template_message(m) for m in conversation],
                                           add_generation_prompt=add_generation_prompt)
            encoded.append((text, tok.encode(text, add_special_tokens=False), ()))
        return self._run(encoded, _per_prompt(sampling_params, len(encoded)), use_tqdm, priority)

    # -- the run ---------------------------------------------------------------------------

    def _run(self, prompts: list[tuple[str | None, list[int], tuple]], params: list[SamplingParams],
             use_tqdm: bool, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Submit every prompt's job (text, ids, image spans), gather their events, return the outputs in order."""
        engine = self._engine
        priorities = _priorities(priority, len(prompts), engine.config.scheduling_policy)
        jobs = []
        for (_, ids, images), p, level in zip(prompts, params, priorities):
            if not ids:
                raise ValueError("a prompt must contain at least one token")
            job = to_job(p, f"offline-{next(self._ids)}", ids, engine.max_context, self._grammar(p), images)
            jobs.append(dataclasses.replace(job, priority=level))
        results = [_Result(text, job, p, engine.tokenizer) for (text, _, _), job, p in zip(prompts, jobs, params)]
        events: queue.Queue[tuple[int, RowEvent]] = queue.Queue()
        progress = _Progress(len(jobs), use_tqdm)
        submitted, open_jobs = 0, set()
        try:
            while submitted < len(jobs) or open_jobs:
                while submitted < len(jobs) and self._submit(jobs[submitted], submitted, events, bool(open_jobs)):
                    open_jobs.add(submitted)
                    submitted += 1
                index, event = self._next_event(events)
                if results[index].add(event):
                    open_jobs.discard(index)
                    progress.done(results[index])
        finally:
            for index in open_jobs:
                engine.cancel(jobs[index].request_id)
            progress.close()
        return [r.output() for r in results]

    def _submit(self, job: Job, index: int, events: queue.Queue, others_open: bool) -> bool:
        """Submit one job; False when the waiting queue is full and others are open (retry
        after their next event)."""
        try:
            self._engine.submit(job, lambda event: events.put((index, event)))
        except AdmissionError as e:
            if e.reason == "queue_full" and others_open:
                return False
            raise ValueError(f"prompt {index}: {e.message}") from None
        return True

    def _next_event(self, events: queue.Queue) -> tuple[int, RowEvent]:
        while True:
            try:
                return events.get(timeout=HEALTH_POLL_S)
            except queue.Empty:
                if self._engine.health() != "ready":
                    raise RuntimeError(f"the engine stopped ({self._engine.health()}) while generating") from None

    def _grammar(self, params: SamplingParams) -> Any:
        """The engine's output constraint for `params` (None when unconstrained).

        Raises:
          GrammarError (a ValueError): a constraint the engine cannot compile or enforce.
        """
        constraint = params.constraint
        if constraint is None:
            return None
        grammar = constraint.grammar_spec()
        self._engine.check_grammar(grammar)  # compiled into the engine's cache before submit
        return grammar

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine this LLM loaded (an engine given to `from_engine` is left running)."""
        if self._owned:
            self._engine.shutdown()
            self._owned = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _warm_up(engine: Any) -> None:
    """Compile every bucket, with a progress bar on stderr (as `ferrox serve` shows)."""
    from tqdm import tqdm

    with tqdm(desc="compiling buckets", unit="shape", file=sys.stderr, leave=False) as bar:
        def on_compile(done: int, total: int, _key: Any) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        engine.warmup(on_compile)


def _prompt_text_and_ids(item: str | dict, tok: Any) -> tuple[str | None, list[int]]:
    if isinstance(item, str):
        return item, tok.encode(item)
    if isinstance(item, dict) and "prompt_token_ids" in item:
        ids = [int(t) for t in item["prompt_token_ids"]]
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})")
        return item.get("prompt"), ids
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"], tok.encode(item["prompt"])
    raise TypeError(f"a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [int]}}; got {item!r:.80}")


def _multi_modal_images(item: str | dict) -> list[bytes]:
    """The file bytes of a prompt's `multi_modal_data` images (PIL images and arrays as PNG)."""
    data = item.get("multi_modal_data") if isinstance(item, dict) else None
    if not data:
        return []
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes images only; got {sorted(data)}")
    if not isinstance(item.get("prompt"), str):
        raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' (with the image markers)")
    images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
    return [image_file_bytes(image) for image in images]


def _template_message(message: dict) -> dict:
    """A message as the chat template takes it: text parts joined by newlines, as the server joins them."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "\n".join(part["text"] for part in content if part.get("type") == "text")}
    return message


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    return params


class _Result:
    """One prompt's output so far: its rows' tokens, text and logprobs."""

    def __init__(self, prompt: str | None, job: Job, params: SamplingParams, tokenizer: Any) -> None:
        self.prompt, self.job, self.params = prompt, job, params
        self._decode = lambda t: tokenizer.decode([t], skip_special_tokens=False)
        self.token_ids: list[list[int]] = [[] for _ in range(job.n)]
        self.text: list[list[str]] = [[] for _ in range(job.n)]
        self.logprobs: list[list[dict]] = [[] for _ in range(job.n)]
        self.cumulative: list[float] = [0.0] * job.n
        self.finish: list[RowEvent | None] = [None] * job.n
        self.prompt_logprobs: list | None = None
        self.num_cached_tokens = 0
        self.num_generated = 0
        self.has_events = False

    def add(self, event: RowEvent) -> bool:
        """Fold in one event; True once every row has finished.

        Raises:
          RuntimeError: the row failed in the engine (or was cancelled under us).
        """
        if event.finish_reason in ("error", "cancelled"):
            raise RuntimeError(f"{self.job.request_id}: generation {event.finish_reason}: "
                               f"{event.error or 'the engine cancelled it'}")
        i = event.index
        if not self.has_events:  # a job's first event carries its prompt-level numbers
            self.has_events = True
            self.num_cached_tokens = event.num_cached_tokens
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self._add_prompt_logprobs(event.prompt_logprobs)
        self.token_ids[i].extend(event.token_ids)
        self.text[i].append(event.text)
        k = self.params.logprobs
        if k is not None:
            for r in event.logprobs or ():
                self.logprobs[i].append(logprob_dict(int(r.token_id), r.logprob, r.top_logprobs, k, self._decode))
                self.cumulative[i] += float(r.logprob)
        if event.finish_reason is not None:
            self.finish[i] = event
            self.num_generated += event.num_generated_tokens
        return all(f is not None for f in self.finish)

    def _add_prompt_logprobs(self, entries: Iterable[Any]) -> None:
        ids = self.job.prompt_token_ids
        k = self.params.prompt_logprobs or 0
        self.prompt_logprobs = [None] + [logprob_dict(int(t), lp, top, k, self._decode)
                                         for t, (lp, top) in zip(ids[1:], entries)]

    def output(self) -> RequestOutput:
        wants_logprobs = self.params.logprobs is not None
        choices = [CompletionOutput(index=i, text="".join(self.text[i]), token_ids=self.token_ids[i],
                                    cumulative_logprob=self.cumulative[i] if wants_logprobs else None,
                                    logprobs=self.logprobs[i] if wants_logprobs else None,
                                    finish_reason=self.finish[i].finish_reason,
                                    stop_reason=self.finish[i].stop_string)
                   for i in range(self.job.n)]
        return RequestOutput(request_id=self.job.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.job.prompt_token_ids), prompt_logprobs=self.prompt_logprobs,
                             outputs=choices, num_cached_tokens=self.num_cached_tokens)


class _Progress:
    """Finished prompts, and the prompt / output tokens/s so far (vLLM's bar)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)
        self.started = time.perf_counter()
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    def done(self, result: _Result) -> None:
        if self.bar is None:
            return
        self.num_prompt_tokens += len(result.job.prompt_token_ids)
        self.num_output_tokens += result.num_generated
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"input: {self.num_prompt_tokens / elapsed:.1f} tok/s, "
                                 f"output: {self.num_output_tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _priorities(priority: Sequence[int] | None, num_prompts: int, policy: str) -> list[int]:
    """One priority per prompt (all 0 when None), each checked before anything is submitted.

    Raises:
      ValueError: not one per prompt, out of range, or non-zero under the fcfs policy.
    """
    if priority is None:
        return [0] * num_prompts
    levels = list(priority)
    if len(levels) != num_prompts:
        raise ValueError(f"priority has {len(levels)} entries for {num_prompts} prompts; give one per prompt")
    for i, level in enumerate(levels):
        refusal = check_priority(level, policy, f"priority[{i}]")
        if refusal is not None:
            raise ValueError(refusal)
    return levels
