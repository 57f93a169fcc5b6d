"""The suite's own guard (tests/conftest.py): a long-lived test worker drops JAX's
compiled programs before their memory mappings reach the kernel's limit, past which
XLA:CPU segfaults compiling the next one."""

import sys

import jax.numpy as jnp
import pytest

from tests.conftest import memory_maps, release_compiled_programs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_compiled_programs_are_dropped_past_the_limit_alone(rng):
    """Each new shape compiles new executables, each holding mappings: above the limit the
    guard frees them (the count falls back below where it started), below it nothing."""
    before = memory_maps()
    for n in rng.permutation(40)[:20] + 100:  # shapes no other test compiles
        (jnp.sin(jnp.ones((int(n), 3))) * 2).block_until_ready()
    grown = memory_maps()
    assert grown > before + 20, (before, grown)  # the executables hold mappings
    assert not release_compiled_programs(limit=grown + 1000)
    assert memory_maps() >= grown - 5
    assert release_compiled_programs(limit=before)
    assert memory_maps() < grown - 20, (before, grown, memory_maps())
    assert float(jnp.sin(jnp.ones(3)).sum()) == pytest.approx(3 * 0.8414709848)  # JAX works on
