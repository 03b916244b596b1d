#!/usr/bin/env bash
# On the device machine (docs/gpu.md): use the carried wheels only where the image's are
# too old, print the GPU, then run the device check into $OUT. Extra arguments go to
# tools/device/device_check.py (e.g. --phases engine,rewarm --budget-s 240).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    # exit status 1 when the image's flax predates the NNX API this code uses
    if [ "${FERROX_USE_CARRIED:-0}" = 1 ] || ! python3 -c \
        'import flax, sys; sys.exit(tuple(int(x) for x in flax.__version__.split(".")[:2]) < (0, 12))'; then
        export PYTHONPATH=/tmp/site
        echo "device_run: using the carried wheels: $(ls .whl)"
    fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
exec python3 -m tools.device.device_check --out "${OUT:-/tmp/device_check_out}" "$@"
