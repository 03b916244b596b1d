"""tools/bench/profile_thunks.py groups a compiled executable's thunks by what they do."""

import jax
import jax.numpy as jnp

from tools.bench.profile_thunks import group_events, thunk_kinds


def _hlo():
    return jax.jit(lambda x, y: jnp.cos(x) * y + 1.0).lower(jnp.ones(64), jnp.ones(64)).compile().as_text()


def test_fusions_are_named_by_the_ops_inside():
    kinds = thunk_kinds(_hlo())
    assert any("cosine" in k and k.startswith("fusion[") for k in kinds.values()), kinds


def test_events_grouped_per_forward():
    kinds = {"a.1": "fusion[add]", "a.2": "fusion[add]", "c.1": "custom-call k"}
    events = [{"ph": "X", "name": "a.1", "dur": 10.0}, {"ph": "X", "name": "a.2", "dur": 30.0},
              {"ph": "X", "name": "c.1", "dur": 1000.0}, {"ph": "X", "name": "unknown", "dur": 5.0}]
    rows = group_events(events, kinds, forwards=2)
    assert rows[0] == {"kind": "custom-call k", "ms_per_forward": 0.5, "thunks_per_forward": 0.5}
    assert rows[1] == {"kind": "fusion[add]", "ms_per_forward": 0.02, "thunks_per_forward": 1.0}
    assert len(rows) == 2
