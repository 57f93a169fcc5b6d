"""The device's own peaks, measured in the run: a bf16 matmul's FLOP/s and the copy
bandwidth, beside the data sheet's bf16 peak."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from attention import timed  # bench/attention.py: compile s, median s, bytes

from gpu_suite.sizes import Sizes
from jaxformer.training.metrics import PEAK_BF16_FLOPS, measured_matmul_flops


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of x + 1 over a large float32 array: every byte read once and written once."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    _, seconds, _ = timed(lambda x: x + 1, x, repeats=repeats)
    return 2 * nbytes / seconds


def device_info(sizes: Sizes, repeats: int) -> dict:
    d = jax.devices()[0]
    sheet = next((f for name, f in PEAK_BF16_FLOPS.items() if name in d.device_kind), None)
    return {"backend": jax.default_backend(), "device_kind": d.device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "peak_bf16_flops_datasheet": sheet,
            "matmul_bf16_flops_measured": measured_matmul_flops(sizes.matmul_n, jnp.bfloat16,
                                                                repeats=repeats),
            "copy_bytes_per_s_measured": copy_bandwidth(sizes.copy_bytes, repeats)}
