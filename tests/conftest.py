import os
import pathlib
import secrets
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `from tests.conftest import REPO` and train.py imports
    sys.path.insert(0, str(REPO))


@pytest.fixture(autouse=True)
def rng(request, monkeypatch):
    """Each test's NumPy generator, from a fresh seed that a failure's report shows
    (JAXFORMER_TEST_SEED=<seed> repeats the test's draws). A test module's own `rng` (the
    one its helpers draw from) is rebound to it for the test."""
    seed = int(os.environ.get("JAXFORMER_TEST_SEED") or secrets.randbits(32))
    print(f"JAXFORMER_TEST_SEED={seed}")  # pytest shows it when the test fails
    gen = np.random.default_rng(seed)
    if isinstance(getattr(request.module, "rng", None), np.random.Generator):
        monkeypatch.setattr(request.module, "rng", gen)
    return gen


def np_log_softmax(logits):
    """float64 log-softmax over the last axis: the tests' reference for log-probs."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_global_norm(tree):
    """float64 global L2 norm of a pytree's leaves (what clipping and grad_norm use)."""
    import jax
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                             for x in jax.tree.leaves(tree))))


def xla_flags(devices=None):
    """This process's XLA_FLAGS (e.g. the tests' -O0) for a subprocess, with `devices`
    fake CPU devices instead of any count set here."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
