"""What the test tiers share, and no tests: tiny random checkpoints (tiny_model), the
scripted runner and byte tokenizer (scripted), engine and runner builders (engine_helpers),
the in-process server (server_harness), fault injection (faults, fault_serve), family,
LoRA and GGUF helpers, and the probes the system tier runs as subprocesses by path
(sharding_probe, lora_sharding_probe, shared_compiles_probe, spec_driver)."""
