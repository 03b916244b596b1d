# The block kernel's float path (many rows: the L1 panel) against XLA's float32 dot on
# float32 weights of the same shapes, alternated (15 rounds). Run from the repository root:
#   .venv/bin/python bench/quant/probes/panel_vs_xla.py
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # tests/, tools/
import numpy as np, jax, jax.numpy as jnp
from models import cpu_kernels
from models.gguf_blocks import block_matmul, make_weight, with_kernel, dequantize_host
from tests.models.test_block_matmul import random_blocks
from tools.bench.bench_cpu_kernels import alternating_us
rng = np.random.default_rng(0)
blocked = jax.jit(block_matmul); dot = jax.jit(lambda x, w: x @ w)
for m in (32, 128):
    for k, n, fmt in ((576, 1536, "q4_1"), (1536, 576, "q4_1"), (576, 49152, "q8_0")):
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        raw = random_blocks(fmt, n, k)
        w = make_weight(raw, fmt, k)
        wf = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
        wk = with_kernel(w, cpu_kernels.BLOCK_TARGET, 0)
        a, b = alternating_us([lambda: blocked(x, wk), lambda: dot(x, wf)], 15)
        fl = 2 * m * k * n
        print(f"m={m} [{k},{n}] {fmt}: panel {a:,.0f} us ({fl/a/1e3:.0f} GF/s)  xla f32 {b:,.0f} us ({fl/b/1e3:.0f} GF/s)", flush=True)
