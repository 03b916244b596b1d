"""Memory bounds (`ferrox_jax/memory_bounds.py`): settings that size memory are refused
before anything is allocated, naming the field and what fits; the int32 ceilings hold in
`EngineConfig` whatever the device; `ferrox serve` says it in one line naming the flag and
variable. The arithmetic is checked against a given `Room`, so the expected numbers come
from the code and the shapes below, not from this machine's free memory."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest

from api.config import ServerConfig
from ferrox_jax import memory_bounds
from ferrox_jax.config import EngineConfig
from ferrox_jax.memory_bounds import GIB, INT32_MAX, MAX_USABLE_KV_BLOCKS, Footprint, MemoryBoundError, Room
from models.config import ModelConfig

# The API tests' tiny Llama (tests/support/tiny_model.py): 2 layers, 2 KV heads of 16, vocab 384.
TINY = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 16 * 4  # K and V x 2 layers x 2 heads x 16 positions x 16 dims x float32
FOOTPRINT = Footprint(TINY, BYTES_PER_BLOCK, 4, "cpu")
ROOM = Room(GIB, "host memory")
SMALL = EngineConfig(kv_blocks=64, max_seqs=2, prefill_chunk=32, max_context=1024)


# -- the ceilings the index types set, whatever the device ----------------------------------

@pytest.mark.parametrize("fields, says", [
    (dict(kv_blocks=2**62), f"kv_blocks must be at most {MAX_USABLE_KV_BLOCKS}"),
    (dict(kv_blocks=MAX_USABLE_KV_BLOCKS + 1), f"kv_blocks must be at most {MAX_USABLE_KV_BLOCKS}"),
    (dict(kv_blocks=0), "kv_blocks must be an int >= 1"),
    (dict(kv_blocks=48.0), "kv_blocks must be an int"),
    (dict(kv_memory_gib=math.inf), "kv_memory_gib must be a finite number"),
    (dict(kv_memory_gib=math.nan), "kv_memory_gib must be a finite number"),
    (dict(max_context=2**31), "max_context must be at most"),
    (dict(block_size=2**29), "block_size must be at most"),
    (dict(max_loras=2**20, max_lora_rank=2**12), "max_loras + 1 times max_lora_rank"),
])
def test_engine_config_refuses_values_the_int32_indices_cannot_address(fields, says):
    with pytest.raises(ValueError, match=re.escape(f"EngineConfig.{says}")):
        EngineConfig(**fields)


def test_the_largest_addressable_values_are_accepted():
    # 2**31 - 1 usable blocks and the null block: ids 0 .. 2**31 - 1, the largest int32; a block
    # table of 16-position blocks rounded to 8 blocks must end at or below the largest int32 position.
    assert EngineConfig(kv_blocks=MAX_USABLE_KV_BLOCKS).kv_blocks == MAX_USABLE_KV_BLOCKS == 2**31 - 1
    assert EngineConfig(kv_blocks=1).kv_blocks == 1, "one usable block (the cache holds two)"
    most = memory_bounds.max_positions(16)
    assert memory_bounds.table_width(most, 16) * 16 <= INT32_MAX < memory_bounds.table_width(most + 1, 16) * 16
    assert EngineConfig(max_context=most).max_context == most


def test_block_tables_are_rounded_as_the_attention_loop_reads_them():
    from ferrox_jax.runner import block_table_width
    from models.attention import ATTENTION_CHUNK_BLOCKS

    assert memory_bounds.TABLE_ROUND_BLOCKS == ATTENTION_CHUNK_BLOCKS, "keep the jax-free copy equal"
    for context, block_size in ((1, 16), (16, 16), (17, 16), (2048, 16), (1000, 7)):
        assert memory_bounds.table_width(context, block_size) == block_table_width(context, block_size)


# -- what fits the device ---------------------------------------------------------------------

def test_a_cache_larger_than_the_room_names_the_field_and_the_most_blocks_that_fit():
    with pytest.raises(MemoryBoundError) as e:
        FOOTPRINT.check(SMALL, ROOM, overrides={"kv_blocks": 2**40})
    assert e.value.field == "kv_blocks" and e.value.code == "insufficient_memory"
    message = str(e.value)
    assert message.startswith("kv_blocks 1099511627776 needs 8,388,608.0 GiB"), message  # 2**40 x 8 KiB
    assert "host memory has 1.0 GiB free" in message, message
    step = FOOTPRINT.demand(SMALL).step_bytes  # max_context given: the step does not change with the blocks
    most = (GIB - step) // BYTES_PER_BLOCK - 1  # what is left of 1 GiB beside the step, in 8 KiB blocks, less the null block
    assert message.endswith(f"ask for at most kv_blocks {most}"), message


def test_a_budget_larger_than_the_room_names_kv_memory_gib_and_the_budget_that_fits():
    config = dataclasses.replace(SMALL, kv_blocks=None, kv_memory_gib=1e9)
    with pytest.raises(MemoryBoundError) as e:
        FOOTPRINT.check(config, ROOM)
    rest = FOOTPRINT.demand(config).step_bytes  # max_context given: the step is fixed
    assert e.value.field == "kv_memory_gib" and str(e.value).startswith("kv_memory_gib 1e+09 needs"), str(e.value)
    expected = math.floor((GIB - rest) / GIB * 100) / 100  # (1 GiB - the step) in GiB, rounded down to 0.01
    assert str(e.value).endswith(f"ask for at most kv_memory_gib {expected:g}"), str(e.value)


def test_a_rebuild_counts_the_cache_it_frees_and_the_weights_it_reads_again():
    old = FOOTPRINT.demand(SMALL)
    room = Room(old.total - old.kv_bytes, "host memory")  # free memory: all but the old cache's share
    with pytest.raises(MemoryBoundError):
        FOOTPRINT.check(SMALL, room)  # the same cache again does not fit beside the old one...
    FOOTPRINT.check(SMALL, room, freed_bytes=old.kv_bytes)  # ... but does once the old one is freed
    with pytest.raises(MemoryBoundError, match="the weights 1.0 MiB; host memory has .* once the cache is freed"):
        FOOTPRINT.check(SMALL, room, freed_bytes=old.kv_bytes, weights_bytes=2**20, blame="kv_blocks",
                        note=" once the cache is freed")  # ... and not beside a second copy of the weights


@pytest.mark.parametrize("fields, field", [
    (dict(max_seqs=2**24), "max_seqs"),
    (dict(max_loras=100_000, max_lora_rank=64), "max_loras"),
    (dict(max_context=2**30), "max_context"),
    (dict(prefill_chunk=32, max_batched_tokens=2**30), "max_batched_tokens"),
    (dict(prefill_chunk=2**26, max_context=2**20), "prefill_chunk"),
])
def test_rows_token_budgets_context_and_lora_slots_are_bounded_by_the_room(fields, field):
    config = EngineConfig(kv_blocks=64, **fields)
    with pytest.raises(MemoryBoundError) as e:
        FOOTPRINT.check(config, ROOM)
    assert e.value.field == field and str(e.value).startswith(f"{field} {getattr(config, field)} needs"), str(e.value)
    most = int(str(e.value).rsplit(f"ask for at most {field} ", 1)[1])
    assert FOOTPRINT.demand(dataclasses.replace(config, **{field: most})).total <= GIB, "what it offers fits"


def test_an_unknown_room_leaves_only_the_ceilings():
    FOOTPRINT.check(EngineConfig(kv_blocks=2**30), Room(None, "device tpu:0"))  # no memory reported: no memory check
    with pytest.raises(MemoryBoundError, match="more than the 2147483648 int32 block ids") as e:
        FOOTPRINT.check(SMALL, Room(None, "device tpu:0"), overrides={"kv_blocks": None, "kv_memory_gib": 1e12})
    assert e.value.field == "kv_memory_gib" and e.value.code == "invalid_value"


# -- the engine builder checks before it allocates ----------------------------------------------

@pytest.fixture(scope="module")
def checkpoint():
    from tests.support.server_harness import api_checkpoint

    return str(api_checkpoint())


def test_the_build_refuses_a_cache_too_big_before_reading_the_weights(checkpoint, monkeypatch):
    from ferrox_jax import engine_builder
    from ferrox_jax.engine import Engine

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read for a cache that cannot fit")

    monkeypatch.setattr(engine_builder, "_build_model", no_weights)
    with pytest.raises(MemoryBoundError, match="^kv_blocks 1073741824 needs .* ask for at most kv_blocks"):
        Engine.load(EngineConfig(model=checkpoint, dtype="float32", kv_blocks=2**30))


def test_the_check_after_the_weights_runs_before_the_cache_is_allocated(checkpoint, monkeypatch):
    from ferrox_jax import engine_builder
    from ferrox_jax.engine import Engine

    rooms = iter([Room(64 * GIB, "host memory"), Room(2**20, "host memory")])  # the weights took all but 1 MiB
    monkeypatch.setattr(engine_builder, "device_room", lambda devices: next(rooms))

    def no_cache(*args, **kwargs):
        raise AssertionError("the KV cache was allocated although it cannot fit")

    monkeypatch.setattr(engine_builder, "ModelRunner", no_cache)
    with pytest.raises(MemoryBoundError, match="host memory has 1.0 MiB free after the weights"):
        Engine.load(EngineConfig(model=checkpoint, dtype="float32", kv_blocks=512))


# -- server byte caps -----------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [dict(resumable_max_bytes=2**50), dict(response_cache_max_bytes=2**60),
                                    dict(max_body_bytes=2**60)])
def test_byte_caps_past_the_hosts_memory_are_refused(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"ServerConfig.{name}.* must fit in this host's memory"):
        ServerConfig(**fields)


# -- ferrox serve: one line naming the flag and the variable -------------------------------------

def _serve(argv, extra_env=None):
    """`ferrox serve ARGV` in a fresh interpreter; returns (exit status, stderr)."""
    from tests.support.server_harness import free_port

    code = "import sys\nfrom api.cli import main\nsys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(free_port()), *argv],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **(extra_env or {})})
    return out.returncode, out.stderr


@pytest.mark.parametrize("argv, env, says", [
    (["--kv-blocks", str(2**30)], {}, "--kv-blocks (FERROX_CB_KV_BLOCKS) 1073741824 needs"),
    (["--kv-memory-gib", "1e12"], {}, "--kv-memory-gib (FERROX_KV_MEMORY_GIB) 1e+12 needs"),
    ([], {"FERROX_CB_KV_BLOCKS": str(2**62)}, "--kv-blocks (FERROX_CB_KV_BLOCKS) must be at most 2147483647"),
])
def test_serve_refuses_a_cache_the_device_cannot_hold_in_one_line_naming_the_flag(checkpoint, argv, env, says):
    status, stderr = _serve(["--model", checkpoint, "--compile-cache-dir", "off", *argv], env)
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    lines = [line for line in stderr.splitlines() if says in line]
    assert len(lines) == 1, f"one line saying {says!r}:\n{stderr[-2000:]}"
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-2000:]
    if "needs" in says:
        assert "free; ask for at most --" in lines[0], lines[0]


# -- the default KV budget: what the rows need, within a ceiling ----------------------------

def test_without_a_budget_the_cache_holds_every_row_a_whole_context():
    config = EngineConfig(max_seqs=8, max_context=512)  # no kv_blocks, no kv_memory_gib
    # 8 rows x 512 / 16 = 32 blocks each, + the null block
    assert memory_bounds.kv_blocks_for(config, BYTES_PER_BLOCK, TINY.max_position_embeddings) == 8 * 32 + 1
    assert FOOTPRINT.demand(config).num_blocks == 257, "the bounds check sizes the cache as the builder does"
    # no max_context: the trained context, 2048 / 16 = 128 blocks a row
    trained = EngineConfig(max_seqs=3)
    assert memory_bounds.kv_blocks_for(trained, BYTES_PER_BLOCK, 2048) == 3 * 128 + 1


def test_the_default_budget_is_capped_and_an_explicit_one_wins_either_way():
    huge = EngineConfig(max_seqs=32)  # 32 rows x 131072 trained positions: far past the ceiling
    ceiling = int(memory_bounds.DEFAULT_KV_MEMORY_GIB * GIB // BYTES_PER_BLOCK)
    assert memory_bounds.kv_blocks_for(huge, BYTES_PER_BLOCK, 131072) == ceiling
    small = EngineConfig(max_seqs=8, max_context=512, kv_memory_gib=1.0)
    assert memory_bounds.kv_blocks_for(small, BYTES_PER_BLOCK, 2048) == GIB // BYTES_PER_BLOCK, \
        "an explicit budget is used as given, above the rows' need"
    tight = EngineConfig(max_seqs=8, max_context=512, kv_memory_gib=0.001)
    assert memory_bounds.kv_blocks_for(tight, BYTES_PER_BLOCK, 2048) == int(0.001 * GIB) // BYTES_PER_BLOCK
    assert memory_bounds.kv_blocks_for(EngineConfig(kv_blocks=9), BYTES_PER_BLOCK, 2048) == 9 + 1  # + the null block


def test_a_default_budget_that_does_not_fit_is_named_as_the_default():
    config = EngineConfig(max_seqs=8, max_context=512)
    with pytest.raises(MemoryBoundError) as e:
        FOOTPRINT.check(config, Room(BYTES_PER_BLOCK * 100, "host memory"))
    assert e.value.field == "kv_memory_gib" and "kv_memory_gib (default: the rows' need" in str(e.value), str(e.value)

