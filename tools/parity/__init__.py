"""Logits parity: compare_logits checks ferrox_jax's logits and greedy tokens against HF
transformers, our own float32 or a reference file; llamacpp_logits writes llama.cpp's in
the same format. The format and metrics are models/reference.py's. docs/compare_logits.md."""
