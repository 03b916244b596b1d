"""`ferrox serve` with a test fault in its runner: `python -m tests.support.fault_serve serve --model ...`.

Reads the fault from `FERROX_FAULT_INJECT` (`tests/support/faults.py:FaultSpec`) and runs the real CLI
with the engine builder's runner-wrapping hook set to `tests/support/faults.py:FaultyRunner`, so
the server, its batcher and its exit codes meet the fault as they would a broken device.
Tests only (tests/system/test_engine_faults.py); the product has no such switch.
"""

from __future__ import annotations

import os
import sys

from api.cli import main
from tests.support.faults import ENV, FaultSpec, FaultyRunner

if __name__ == "__main__":
    spec = FaultSpec.parse(os.environ[ENV])
    sys.exit(main(sys.argv[1:], wrap_runner=lambda runner: FaultyRunner(runner, spec)))
