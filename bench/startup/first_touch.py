"""What placing a model's weights costs in fresh memory: the first touch of new pages.

    python bench/startup/first_touch.py --mib 667 --rounds 2 --idle 30

Each sample is a new process that allocates `--mib` MiB and copies a source array into
it with `models/gguf_blocks.py:parallel_copy` at 1 thread and at `copy_threads()`
threads (alternated), after `--idle` seconds of sleep. In a VM with free page reporting
(virtio-balloon) the guest hands pages it has not used lately back to its host, and the
first touch of each such page costs a host fault: one idle minute is enough on the 2-vCPU
host of docs/benchmarks.md. Without the idle wait the pages are the ones the last sample
freed and the copy runs at memory speed. Prints one JSON line per sample.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import numpy as np
from models import gguf_blocks
n, threads = int(sys.argv[1]) << 20, int(sys.argv[2])
gguf_blocks.copy_threads = lambda: threads
src = np.ones((n >> 16, 1 << 16), np.uint8)  # touched now: only the copy's target is fresh
t = time.perf_counter()
dst = np.empty_like(src)
gguf_blocks.parallel_copy(dst, src)
print(json.dumps({"threads": threads, "mib": n >> 20, "copy_s": round(time.perf_counter() - t, 3)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=667, help="the 1B Q4_K_M's weights are 636 MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of sleep before each sample")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from models.gguf_blocks import copy_threads
    for _ in range(args.rounds):
        for threads in (1, copy_threads()):
            time.sleep(args.idle)
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.mib), str(threads)], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
            print(out, flush=True)


if __name__ == "__main__":
    main()
