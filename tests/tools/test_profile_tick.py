"""tools/bench/profile_tick.py reads each thread's own CPU time: a thread that computes is
charged what it computed, one that sleeps nothing (its timings are never asserted)."""

from __future__ import annotations

import threading
import time

from tools.bench.profile_tick import thread_cpu_s

BUSY_S = 0.2


def test_a_computing_thread_and_a_sleeping_one_read_apart():
    """The figure per thread comes from /proc: the busy thread's reading grows by its
    own CPU time (to the clock tick), the sleeping one's does not (the negative control)."""
    start, done, release = threading.Event(), threading.Event(), threading.Event()
    ids: dict[str, int] = {}
    spent: dict[str, float] = {}

    def busy() -> None:
        ids["busy"] = threading.get_native_id()
        start.wait(10)  # after the first reading
        begin = time.thread_time()
        while time.thread_time() - begin < BUSY_S:
            pass
        spent["busy"] = time.thread_time() - begin
        done.set()
        release.wait(10)

    def idle() -> None:
        ids["idle"] = threading.get_native_id()
        release.wait(10)

    threads = [threading.Thread(target=idle), threading.Thread(target=busy)]
    for t in threads:
        t.start()
    while len(ids) < 2:
        time.sleep(0.001)
    before = thread_cpu_s()
    start.set()
    assert done.wait(30)
    after = thread_cpu_s()
    release.set()
    for t in threads:
        t.join()
    busy_s = after[ids["busy"]] - before[ids["busy"]]
    idle_s = after[ids["idle"]] - before[ids["idle"]]
    assert busy_s >= BUSY_S - 0.05, f"the computing thread read {busy_s:.3f} s for {spent['busy']:.3f} s of CPU"
    assert idle_s < 0.05, f"the sleeping thread was charged {idle_s:.3f} s"
