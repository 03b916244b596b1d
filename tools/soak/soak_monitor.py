"""What the soak watches while it runs: `/health` latency and the server's RSS.

A thread (not a task on the load generator's event loop, which is busy with 64 clients and
would add its own delay to every sample) polls `/health` on its own keep-alive connection
every `interval_s` and `/admin/stats` every `rss_every` samples. The latency is the time
from sending the request to the whole answer, as a liveness probe sees it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import httpx


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class HealthSampler:
    """`with HealthSampler(url, headers, 0.25) as s:` samples until the block ends."""

    def __init__(self, url: str, headers: dict[str, str], interval_s: float, rss_every: int = 20,
                 timeout_s: float = 30.0) -> None:
        self.url, self.headers, self.interval_s = url, headers, interval_s
        self.rss_every, self.timeout_s = rss_every, timeout_s
        self.latencies_ms: list[float] = []
        self.rss_bytes: list[int] = []
        self.non_200: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-health", daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout_s) as client:
            count = 0
            while not self._stop.wait(self.interval_s):
                self._sample(client)
                count += 1
                if count % self.rss_every == 0:
                    self._sample_rss(client)

    def _sample(self, client: httpx.Client) -> None:
        started = time.perf_counter()
        try:
            status = str(client.get("/health").status_code)
        except httpx.HTTPError as e:
            status = type(e).__name__
        self.latencies_ms.append(1000.0 * (time.perf_counter() - started))
        if status != "200":
            self.non_200[status] = self.non_200.get(status, 0) + 1

    def _sample_rss(self, client: httpx.Client) -> None:
        try:
            rss = client.get("/admin/stats").json().get("rss_bytes")
        except (httpx.HTTPError, ValueError):
            return
        if rss:
            self.rss_bytes.append(rss)

    def __enter__(self) -> HealthSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)
