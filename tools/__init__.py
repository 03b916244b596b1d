"""The lab beside the product: benchmarks, the device check, the soak, and the helpers that
regenerate files the repository keeps. Nothing here ships in the wheel (pyproject.toml
packages ferrox_jax, api and models only) and no module of those packages imports it
(tests/tools/test_product_tree.py). What tools and tests share lives in the product:
models/reference.py (reference logits and their metrics), models/known_shapes.py.

Each group is a package; run a tool from the repository root as
`python -m tools.<group>.<name>`:

    bench/    benchmarks: serving, engine steps, kernels, grammar, speculation, LoRA,
              multi-host, routing (results go under results/, summaries to bench/)
    device/   the accelerator check and its phases, report and machine scripts; model sizing
    soak/     the long mixed load against a running server (`python -m tools.soak.soak`)
    parity/   logits against HF transformers, a reference file or llama.cpp
    docs/     writers of docs/grafana-dashboard.json and the web screenshots
    suite/    the test suite's file timings (tests/durations.json)
"""
