"""The soak: a bounded, loopback-only load of mixed valid and hostile requests against a
running `ferrox serve` (soak; its request mix, hostile requests, per-call judging and
monitor in soak_mix, soak_hostile, soak_requests and soak_monitor). docs/operations.md."""
