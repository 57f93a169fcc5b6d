import gc
import os
import pathlib
import secrets
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `from tests.conftest import REPO` and train.py imports
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(items):
    """The modules marked `heavy` (each over 20 s: subprocesses, a server, the 8-device
    worker) and the notebooks run first, each module's tests still together (a module's
    fixtures set up once): `make test`'s two workers then share the short tests at the
    end and finish together, rather than one running a long test alone."""
    items.sort(key=lambda item: not (item.get_closest_marker("heavy")
                                     or item.path.suffix == ".ipynb"))


@pytest.fixture(autouse=True)
def rng(request, monkeypatch):
    """Each test's NumPy generator, from a fresh seed that a failure's report shows
    (JAXFORMER_TEST_SEED=<seed> repeats the test's draws). Every test module's own `rng`
    (the one its helpers draw from: the test's module and those it imports helpers from)
    is rebound to it for the test."""
    seed = int(os.environ.get("JAXFORMER_TEST_SEED") or secrets.randbits(32))
    print(f"JAXFORMER_TEST_SEED={seed}")  # pytest shows it when the test fails
    gen = np.random.default_rng(seed)
    for module in [request.module] + [m for name, m in list(sys.modules.items())
                                      if name.startswith("tests.")]:
        if isinstance(getattr(module, "rng", None), np.random.Generator):
            monkeypatch.setattr(module, "rng", gen)
    return gen


# The tests compile with the classic fusion emitters (XLA_FLAGS in the Makefile: faster to
# compile); a test that reads compiled HLO compiles with XLA's defaults, which users run.
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def memory_maps() -> int:
    """How many memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def map_limit() -> int:
    """The kernel's limit on a process's memory mappings (vm.max_map_count)."""
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 1 << 62


def release_compiled_programs(limit: int) -> bool:
    """Drops JAX's compiled programs when this process holds more than `limit` memory
    mappings. Every XLA:CPU executable keeps its code mapped (about 4 mappings each) for as
    long as JAX caches it, and a test worker compiles thousands: past vm.max_map_count
    (65,530) LLVM cannot map the next one ("LLVM compilation error: Cannot allocate
    memory") and the process segfaults in backend_compile_and_load or in the persistent
    cache's serialize, late in a full run and never in a test alone."""
    if "jax" not in sys.modules or memory_maps() <= limit:
        return False
    import jax
    jax.clear_caches()
    gc.collect()
    return True


CHECK_EVERY = 8  # tests; one test maps a few thousand more at most, far below the margin
_tests_run = [0]


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """Every CHECK_EVERY tests, release_compiled_programs at half vm.max_map_count: reading
    /proc/self/maps grows with the mappings (4 ms a test on average over
    tests/model/test_transformer.py, up to 20,000 mappings), 10-20 s of worker time in a
    full run when read after every test."""
    yield
    _tests_run[0] += 1
    if _tests_run[0] % CHECK_EVERY == 0:
        release_compiled_programs(map_limit() // 2)


def np_log_softmax(logits):
    """float64 log-softmax over the last axis: the tests' reference for log-probs."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


NEAR_TIE = 1e-4  # top two logits this close: two programs' float32 rounding may pick either


def assert_greedy_up_to_near_ties(tokens, logits, tie: float = NEAR_TIE):
    """Greedy tokens [B, n] are the argmax of a reference's logits [B, n, V] for them (its
    forward over the same tokens) up to each row's first difference, and that one only at
    a near-tie (top two logits within `tie`), where two programs' float32 rounding may
    pick either token (the rows part ways after it)."""
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    for row in range(len(tokens)):
        diff = np.flatnonzero(tokens[row] != logits[row].argmax(-1))
        if diff.size:
            assert top2[row, diff[0], 1] - top2[row, diff[0], 0] < tie, (row, tokens[row])


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
