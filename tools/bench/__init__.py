"""Benchmarks: a live server driven over HTTP (bench_serving with its prompts, workloads,
report and plot; bench_burst, bench_router, health_stall) and the engine, kernels and
features timed in one process (bench_engine, bench_cpu_kernels, bench_moe, bench_masks,
bench_grammar, bench_lora, bench_speculative, bench_multihost, profile_verify). Raw
results go under results/ (git-ignored); docs/benchmarks.md keeps the tables and bench/ one
summary file per table."""
