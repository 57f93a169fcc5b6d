"""The CPU grouped matmul (jaxformer.moe.grouped_matmul.tiles) where its tiles leave a
group: a last tile moved back inside the rows over an earlier group's rows, groups shorter
than a tile, and the compiled program's shape (no padded copy of the rows, the kernel
gradient's dots on rows transposed once)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.kinds import FFNS
from jaxformer.moe.experts import GROUPED, expert_mlp
from jaxformer.moe.grouped_matmul import tile_sizes, tiles
from tests.conftest import DEFAULT_EMITTERS

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def definition(x, kernel, sizes, probe):
    """float64 NumPy: each group's rows times its kernel, and the gradients of
    sum(y * probe) for x and the kernels."""
    starts = np.cumsum(sizes) - sizes
    x64, k64, p64 = (a.astype(np.float64) for a in (x, kernel, probe))
    y = np.concatenate([x64[s:s + n] @ k64[g] for g, (s, n) in enumerate(zip(starts, sizes))])
    gx = np.concatenate([p64[s:s + n] @ k64[g].T for g, (s, n) in enumerate(zip(starts, sizes))])
    gk = np.stack([x64[s:s + n].T @ p64[s:s + n] for s, n in zip(starts, sizes)])
    return y, gx, gk


@functools.partial(jax.jit, static_argnums=3)
def value_and_grads(x, kernel, sizes, transpose, probe):
    fn = lambda x, k: jnp.sum(tiles(x, k, sizes, transpose) * probe)  # noqa: E731
    return tiles(x, kernel, sizes, transpose), *jax.grad(fn, argnums=(0, 1))(x, kernel)


def test_tiles_moved_back_keep_the_rows_before_them():
    """360 rows, 5 groups, in tiles of 64 and 32: a first group whose rest after four
    64-row tiles is over 32 rows (one more 64-row tile, run past), a middle group of 5
    rows, an empty one, a group of 36-55 rows (one 64-row tile, moved back inside the rows)
    and a last group of 7 rows whose only tile is moved back over the groups before it;
    forward and gradients against float64."""
    m, d_in, d_out = 360, 6, 5
    assert tile_sizes(m, 5) == (64, 32)
    third = int(rng.integers(36, 56))
    sizes = np.array([m - 12 - third, 5, 0, third, 7])
    x = rng.normal(0, 1, (m, d_in)).astype(np.float32)
    kernel = rng.normal(0, 1, (len(sizes), d_in, d_out)).astype(np.float32)
    probe = rng.normal(0, 1, (m, d_out)).astype(np.float32)
    want_y, want_gx, want_gk = definition(x, kernel, sizes, probe)
    for transpose in (False, True):
        given = np.swapaxes(kernel, 1, 2) if transpose else kernel
        y, gx, gk = value_and_grads(jnp.asarray(x), jnp.asarray(given),
                                    jnp.asarray(sizes, jnp.int32), transpose, jnp.asarray(probe))
        np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gx), want_gx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gk), np.swapaxes(want_gk, 1, 2) if transpose
                                   else want_gk, rtol=1e-5, atol=1e-5)


def test_compiled_gradient_has_no_padded_rows_and_plain_kernel_gradient_dots():
    """The dispatch's grouped matmul, forward and gradient, compiled: no array longer than
    the 300 rows (no padded copy of x, of the output or of the incoming gradient), no
    dot contracting its left operand's first axis (each tile's kernel gradient is a plain
    [in, t] x [t, out] dot on the rows transposed once), and no per-group sum of a kernel's
    shape (each tile's product added into the result in place)."""
    m = 300
    sizes = jnp.asarray([200, 0, 93, 7], jnp.int32)
    x, kernel = jnp.ones((m, 12)), jnp.ones((4, 12, 20))
    fn = jax.jit(jax.grad(lambda x, k: jnp.sum(GROUPED(x, k, sizes) ** 2), argnums=(0, 1)))
    hlo = fn.lower(x, kernel).compile(DEFAULT_EMITTERS).as_text()
    rows = {int(r) for r in re.findall(r"f32\[(\d+),\d+\]", hlo)}
    assert m in rows and max(rows) == m, sorted(rows)[-3:]
    assert " pad(" not in hlo
    dots = re.findall(r"dot\([^\n]*", hlo)
    assert dots and not [d for d in dots if "lhs_contracting_dims={0}" in d]
    # no group's sum of its own, started from zeros and copied into the result: each
    # tile's [in, out] product is added into the result's slice in place
    sums = re.findall(r"f32\[12,20\]\{[\d,]*\} (?:broadcast|add)\(", hlo)
    assert not sums, sums


def test_compiled_gradient_gives_each_loop_its_own_zeros():
    """The experts' SwiGLU (three grouped matmuls: six loops writing rows, three writing
    kernel gradients), forward and gradient with the group sizes an argument as in the
    dispatch, compiled: no array copied in the entry computation. Zeros that XLA could
    share between loops of one shape it would make once and copy for each loop."""
    m, d, f, e = 96, 8, 12, 3
    w = {"wi_gate": jnp.ones((e, d, f)), "wi_up": jnp.ones((e, d, f)), "wo": jnp.ones((e, f, d))}

    def loss(x, w, sizes):
        return jnp.sum(expert_mlp(x, w, FFNS["swiglu"], lambda h, k: GROUPED(h, k, sizes)) ** 2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = fn.lower(jnp.ones((m, d)), w, jnp.asarray([40, 0, 56], jnp.int32)).compile(
        DEFAULT_EMITTERS).as_text()
    entry = hlo.split("\nENTRY ")[1].split("\n}")[0]
    copies = [line.strip()[:120] for line in entry.splitlines() if " copy(" in line
              and re.search(r"= f32\[", line)]
    assert not copies, copies
