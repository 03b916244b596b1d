"""Grammar-engine benchmark: mask and compile cost of llguidance vs xgrammar, and the
cost of applying a packed token bitmask to logits on device.

The measurement behind the engine choice in docs/structured-output.md. On the default
SmolLM2 tokenizer (49152 ids) it walks a realistic document of about 200 tokens through
each constraint kind (a nested JSON schema, any JSON object, a regex, a choice of five
strings, a Lark grammar) and times, per token, filling the next-token bitmask and then
accepting the document's token; and it times compiling each grammar cold and again from
a cache (llguidance: a deep copy of an already built matcher, which is what
`ferrox_jax.grammar.GrammarCompiler` caches; xgrammar: its own compiler cache plus a new
matcher). xgrammar is optional (it pulls torch): without it only llguidance is measured.

    python -m tools.bench.bench_grammar                 # engines, then the device-side apply
    python -m tools.bench.bench_grammar --skip-apply    # engines only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np

# A nested schema: objects in an array in an object, enums, required, bounded numbers.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 60}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "bulk"]}},
                },
                "required": ["sku", "quantity", "price", "tags"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}
ORDER_DOCUMENT = {
    "order_id": "ORD-004217",
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "vip": True},
    "items": [
        {"sku": f"SKU-{i:04d}", "quantity": i + 1, "price": round(3.5 * i + 0.99, 2),
         "tags": [["gift"], ["fragile", "bulk"], []][i % 3]}
        for i in range(4)
    ],
}
LOG_REGEX = r"([0-9]{4}-[0-9]{2}-[0-9]{2} (INFO|WARN|ERROR): [a-z ,]{1,60}\n){1,12}"
LOG_TEXT = "".join(
    f"2025-01-{day:02d} {level}: request {word} finished, cache warm\n"
    for day, level, word in zip(range(1, 11), ["INFO", "WARN", "ERROR"] * 4, "abcdefghij")
)
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
EXPR_LARK = r"""
start: expr
expr: term ((" + " | " - ") term)*
term: factor ((" * " | " / ") factor)*
factor: NUMBER | NAME | "(" expr ")" | NAME "(" expr ("," " " expr)* ")"
NUMBER: /[0-9]+(\.[0-9]+)?/
NAME: /[a-z_]+/
"""
EXPR_TEXT = " + ".join(
    f"max(price_{c} * {i}.5, (tax_{c} - {i * 7}) / rate)" for i, c in enumerate("abcdefghijk")
)
MAX_WHITESPACE_CHARS = 16
MIN_SAMPLES = 600  # short documents (the choice) are walked again until there are this many


def _cases() -> list[tuple[str, str, object, str]]:
    """(name, kind, source, document) per constraint kind."""
    doc = json.dumps(ORDER_DOCUMENT, indent=2)
    return [
        ("json_schema (nested)", "json_schema", ORDER_SCHEMA, doc),
        ("json_object", "json_object", {"type": "object"}, doc),
        ("regex", "regex", LOG_REGEX, LOG_TEXT),
        ("choice of 5", "choice", CHOICES, "negative"),
        ("lark grammar", "lark", EXPR_LARK, EXPR_TEXT),
    ]


def _percentiles_us(samples_s: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max) in µs."""
    arr = np.asarray(samples_s) * 1e6
    return float(np.median(arr)), float(np.percentile(arr, 99)), float(arr.max())


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                          eos_token=sorted(tokenizer.stop_token_ids))

    def compile(self, kind: str, source):
        llg = self.llg
        if kind in ("json_schema", "json_object"):
            options = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{1,{MAX_WHITESPACE_CHARS}}}"}
            grammar = llg.LLMatcher.grammar_from_json_schema(source, overrides=options)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(source)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(source))
        else:
            grammar = llg.LLMatcher.grammar_from_lark(source)
        matcher = llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def step(self, matcher, mask: np.ndarray, token: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        t1 = time.perf_counter()
        assert (mask[token // 32] >> (token % 32)) & 1, "document token not allowed"
        assert matcher.consume_token(token), matcher.get_error()
        return t1 - t0, time.perf_counter() - t1


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.stop_token_ids))
        self.cached = xgrammar.GrammarCompiler(self.info, max_threads=1)

    def _compile_with(self, compiler, kind: str, source):
        if kind in ("json_schema", "json_object"):
            return compiler.compile_json_schema(source, max_whitespace_cnt=MAX_WHITESPACE_CHARS)
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "choice":
            return compiler.compile_lark("start: " + " | ".join(json.dumps(c) for c in source))
        return compiler.compile_lark(source)

    def compile(self, kind: str, source):
        fresh = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return self._compile_with(fresh, kind, source), (kind, source)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(self._compile_with(self.cached, *compiled[1]))

    def step(self, matcher, mask: np.ndarray, token: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask[None, :])
        t1 = time.perf_counter()
        assert (mask[token // 32] >> (token % 32)) & 1, "document token not allowed"
        assert matcher.accept_token(token)
        return t1 - t0, time.perf_counter() - t1


def _median_s(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_engines(tokenizer, vocab_size: int) -> None:
    """Print one row per (engine, constraint kind): mask and accept µs, compile ms."""
    engines: list[type] = [_Llguidance]
    try:
        import xgrammar  # noqa: F401

        engines.append(_Xgrammar)
    except ImportError:
        print("xgrammar not installed: measuring llguidance only")
    mask = np.zeros((vocab_size + 31) // 32, np.int32)
    print(f"{'engine':<11} {'constraint':<21} {'tokens':>6} {'mask p50/p99/max µs':>22} "
          f"{'accept p50/p99 µs':>18} {'compile cold ms':>16} {'cached ms':>10}")
    for engine_cls in engines:
        engine = engine_cls(tokenizer, vocab_size)
        for name, kind, source, text in _cases():
            tokens = tokenizer.encode(text, add_special_tokens=False)
            compiled = engine.compile(kind, source)
            cold_s = _median_s(lambda: engine.compile(kind, source))
            cached_s = _median_s(lambda: engine.matcher(compiled))
            mask_s, accept_s = [], []
            for _ in range(max(3, -(-MIN_SAMPLES // len(tokens)))):
                matcher = engine.matcher(compiled)
                for token in tokens:
                    m, a = engine.step(matcher, mask, token)
                    mask_s.append(m)
                    accept_s.append(a)
            m50, m99, m_max = _percentiles_us(mask_s)
            a50, a99, _ = _percentiles_us(accept_s)
            print(f"{engine.name:<11} {name:<21} {len(tokens):>6} {m50:>7.1f}/{m99:<7.1f}/{m_max:<7.0f} "
                  f"{a50:>9.1f}/{a99:<8.1f} {cold_s * 1e3:>16.2f} {cached_s * 1e3:>10.3f}")


def bench_apply(vocab_size: int, rows: tuple[int, ...] = (1, 32), repeats: int = 200) -> None:
    """Print the µs of one jitted `apply_token_bitmask` call per batch size (after warm-up)."""
    import jax
    import jax.numpy as jnp

    from ferrox_jax.token_mask import apply_token_bitmask

    apply = jax.jit(apply_token_bitmask)
    rng = np.random.default_rng(0)
    for b in rows:
        logits = jnp.asarray(rng.standard_normal((b, vocab_size), dtype=np.float32))
        bitmask = jnp.asarray(rng.integers(-(2**31), 2**31, (b, (vocab_size + 31) // 32), dtype=np.int32))
        apply(logits, bitmask).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            apply(logits, bitmask).block_until_ready()
            times.append(time.perf_counter() - t0)
        p50, p99, _ = _percentiles_us(times)
        print(f"apply_token_bitmask B={b:<3} V={vocab_size}: p50 {p50:.1f} µs, p99 {p99:.1f} µs "
              f"on {jax.devices()[0].platform}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.bench_grammar", description=__doc__.split("\n")[0])
    p.add_argument("--skip-apply", action="store_true", help="do not time apply_token_bitmask")
    args = p.parse_args(argv)

    from models.loaders.gguf import config_from_gguf, default_model_path, open_gguf
    from models.tokenizer import Tokenizer

    reader = open_gguf(default_model_path())
    tokenizer, vocab_size = Tokenizer.from_gguf(reader), config_from_gguf(reader).vocab_size
    bench_engines(tokenizer, vocab_size)
    if not args.skip_apply:
        bench_apply(vocab_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
