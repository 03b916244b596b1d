"""Wrong API keys are rate limited per client address, before the key is compared.

Each wrong key presented is remembered for a minute per address; an address with
`--auth-failures-per-minute` (20) failures in the last minute gets 429 (`Retry-After`
until its oldest failure ages out) for every request that needs a key, right or wrong,
until then. The check runs before the comparison, so a guesser learns nothing more once
limited, and it holds whether or not the general `--rate-limit-per-minute` is on. At
most `MAX_TRACKED` addresses are remembered (the oldest forgotten first), so a flood
of addresses cannot grow it without bound.

A request with no key at all (no `Authorization: Bearer`, no `x-api-key`) is a plain 401
that says how to send one and is not counted: it guesses nothing, and counting it would
lock out a client that forgot the header a few times, right key and all, for a minute.
"""

from __future__ import annotations

import collections
import hmac
import math
import time
from typing import Any, Mapping

from api.errors import APIError

WINDOW_S = 60.0
MAX_TRACKED = 65_536


class FailedAuthLimiter:
    """Per-address sliding window of failed key checks; event-loop only."""

    def __init__(self, failures_per_minute: int) -> None:
        self.failures_per_minute = failures_per_minute  # 0: off
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self.num_refused = 0

    def retry_after_s(self, client: str, now: float | None = None) -> int:
        """Seconds until `client` may try a key again; 0 when it may now."""
        if not self.failures_per_minute:
            return 0
        failures = self._failures.get(client)
        if not failures:
            return 0
        now = time.monotonic() if now is None else now
        while failures and now - failures[0] >= WINDOW_S:
            failures.popleft()
        if len(failures) < self.failures_per_minute:
            return 0
        self.num_refused += 1
        return max(1, math.ceil(WINDOW_S - (now - failures[0])))

    def record_failure(self, client: str, now: float | None = None) -> None:
        if not self.failures_per_minute:
            return
        failures = self._failures.pop(client, None) or collections.deque()
        failures.append(time.monotonic() if now is None else now)
        self._failures[client] = failures  # most recent last
        while len(self._failures) > MAX_TRACKED:
            self._failures.popitem(last=False)


def check_key(state: Any, api_key: bytes, headers: Mapping[str, str], client: str) -> None:
    """Raise 429 when `client` is over the failed-key or the general rate limit, else 401
    unless the request carries `api_key` (`Authorization: Bearer KEY`, or Anthropic's
    `x-api-key`). The limits come first: a limited client's guesses are not compared.
    Only a wrong key counts as a failure; a missing one is a 401 that says what to send."""
    limiter: FailedAuthLimiter = state.auth_limiter
    retry_after = limiter.retry_after_s(client)
    if retry_after:
        raise APIError(429, "too many wrong API keys from this address; retry later", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
    if state.over_rate_limit(client):
        raise APIError(429, "rate limit exceeded", type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": "60"})
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    given = token.strip().encode("utf-8") if scheme.lower() == "bearer" else b""
    if not given:  # Anthropic's clients send the key as x-api-key
        given = headers.get("x-api-key", "").strip().encode("utf-8")
    if not given:
        raise APIError(401, "missing API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given, api_key):
        limiter.record_failure(client)
        raise APIError(401, "invalid API key: it does not match the server's --api-key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
