"""`ferrox serve` with a test fault in its runner: `python -m tests.support.fault_serve serve --model ...`.

Reads the fault from `FERROX_FAULT_INJECT` (`tests/support/faults.py:FaultSpec`) and runs the real CLI
with the engine builder's runner-wrapping hook set to `tests/support/faults.py:FaultyRunner`, so
the server, its batcher and its exit codes meet the fault as they would a broken device; with
`FERROX_TEST_DROP_STATE_COPIES` set, the hook is `StateCopyDropper` instead (a multi-host
follower's dropped state copies). The hook wraps a multi-host follower's engine too.
Tests only (tests/system/test_engine_faults.py, tests/system/test_multihost_state.py); the
product has no such switch.
"""

from __future__ import annotations

import os
import sys

from api.cli import main
from tests.support.faults import DROP_STATE_COPIES_ENV, ENV, FaultSpec, FaultyRunner, StateCopyDropper

if __name__ == "__main__":
    if DROP_STATE_COPIES_ENV in os.environ:
        flag = os.environ[DROP_STATE_COPIES_ENV]
        sys.exit(main(sys.argv[1:], wrap_runner=lambda runner: StateCopyDropper(runner, flag)))
    spec = FaultSpec.parse(os.environ[ENV])
    sys.exit(main(sys.argv[1:], wrap_runner=lambda runner: FaultyRunner(runner, spec)))
