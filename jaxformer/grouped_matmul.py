"""The grouped matmul of a mixture of experts: rows sorted by group (expert), each group
multiplied by its own kernel. Two ways, as a table (GROUPED_MATMULS):

- ragged_dot: jax.lax.ragged_dot, XLA's grouped matmul (GPU and TPU kernels).
- tiles: each group padded to whole tiles of rows, a loop of one 2-D dot per tile with
  its group's kernel (tile_loop). XLA:CPU lowers ragged_dot as a dense dot of every row
  with every group's kernel, masked (E times the work: on a 2-core AMD EPYC, 2048 x 2
  rows, 8 experts of 512 x 1408, 820 ms forward against 27 ms for one dense matmul of
  the rows); tiles pad at most one tile per group (4096 rows, 8 groups: forward 71 ms
  against 48 ms for the rows' one dense dot, gradient 147 against 148).

`grouped_matmul` picks tiles on CPU and ragged_dot elsewhere; both are tested against
the definition (tests/test_moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_dot(x, kernel, sizes):
    """x [M, in] (rows sorted by group), kernel [G, in, out], sizes [G] -> [M, out]."""
    return jax.lax.ragged_dot(x, kernel.astype(x.dtype), sizes)


def tile_rows(m: int, groups: int) -> int:
    """Rows per tile: 1 when there are fewer rows than groups (decoding: no padding), else
    about half a group's mean share, between 16 and 128."""
    return 1 if m <= groups else min(128, max(16, m // (2 * groups)))


def tiles(x, kernel, sizes):
    """As ragged_dot, by whole tiles: group g's rows go to tiles of tile_rows rows (the last
    padded with zeros), each tile multiplied by kernel[its group]."""
    m, d = x.shape
    g = kernel.shape[0]
    tile = tile_rows(m, g)
    n_tiles = m if tile == 1 else -(-m // tile) + min(g, m)  # at most one partial per group
    padded = -(-sizes // tile) * tile  # [G] each group in whole tiles
    ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(g), sizes, total_repeat_length=m)  # [M] each row's group
    pos = (ends - padded)[group] + jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[group]
    buf = jnp.zeros((n_tiles * tile, d), x.dtype).at[pos].set(x)  # [tiles x tile, in]
    tile_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles) * tile, side="right"),
                             g - 1)  # [tiles]; tiles past the last group's are all zeros
    buf = buf.reshape(n_tiles, tile, d)
    if tile == 1:  # decoding: a row each, its kernel gathered (only the chosen ones read)
        out = jnp.einsum("tci,tio->tco", buf, kernel[tile_group].astype(x.dtype))
    else:
        out = tile_loop(buf, kernel, tile_group)  # [tiles, tile, out]
    return out.reshape(n_tiles * tile, -1)[pos]  # [M, out]


@jax.custom_vjp
def tile_loop(buf, kernel, tile_group):
    """buf [tiles, tile, in] -> [tiles, tile, out], tile t times kernel[tile_group[t]]: a
    loop of 2-D dots (XLA:CPU's fast matmul path; a batched dot over gathered kernels ran
    at half its rate and copied every tile's kernel first), its gradient written out as
    the same kind of loop."""
    def body(_, xs):
        x, g = xs
        return None, jnp.dot(x, kernel[g].astype(x.dtype))
    return jax.lax.scan(body, None, (buf, tile_group))[1]


def _tile_loop_fwd(buf, kernel, tile_group):
    return tile_loop(buf, kernel, tile_group), (buf, kernel, tile_group)


def _tile_loop_bwd(saved, d_out):
    buf, kernel, tile_group = saved

    def body(d_kernel, xs):  # each tile: its input's gradient, its kernel's share added
        x, dy, g = xs
        return d_kernel.at[g].add(jnp.dot(x.T, dy)), jnp.dot(dy, kernel[g].astype(dy.dtype).T)
    d_kernel, d_buf = jax.lax.scan(body, jnp.zeros(kernel.shape, d_out.dtype),
                                   (buf, d_out, tile_group))
    return d_buf, d_kernel.astype(kernel.dtype), None


tile_loop.defvjp(_tile_loop_fwd, _tile_loop_bwd)


GROUPED_MATMULS = {"ragged_dot": ragged_dot, "tiles": tiles}


def grouped_matmul(x, kernel, sizes, impl: str | None = None):
    """x [M, in] sorted by group, kernel [G, in, out], sizes [G] (summing to M) -> [M, out];
    impl: a GROUPED_MATMULS name (None: tiles on CPU, ragged_dot elsewhere)."""
    if impl is None:
        impl = "tiles" if jax.default_backend() == "cpu" else "ragged_dot"
    return GROUPED_MATMULS[impl](x, kernel, sizes)  # each widens the kernel where it reads it


def grouped_dot(x, kernel, sizes):
    """grouped_matmul as jaxformer.moe's dropless dispatch calls it. Under jax.vmap (beam
    search batches rows) tiles batches as the plain jnp ops it is made of."""
    return grouped_matmul(x, kernel, sizes)
