"""The grouped matmul of a mixture of experts: rows sorted by group (expert), each group
multiplied by its own kernel. Two ways, as a table (GROUPED_MATMULS):

- ragged_dot: jax.lax.ragged_dot, XLA's grouped matmul (GPU and TPU kernels).
- tiles: a loop over the groups, each reading its kernel once, and inside it a loop of
  2-D dots over tiles of the group's rows, in place (tile_sizes). XLA:CPU lowers
  ragged_dot as a dense dot of every row with every group's kernel, masked (E times the
  work: on a 2-core AMD EPYC, 2048 x 2 rows, 8 experts of 512 x 1408, 820 ms forward
  against 27 ms for one dense matmul of the rows).

tiles reads and writes the sorted rows where they are: a group's rows go in tiles of the
largest size while whole ones fit, then one of each smaller size that fits (the group's
size in binary), and one tile runs past the group's end where the rest is within the
smallest size of a tile (a group of 500 rows is one 512-row dot, not 256 + 128 + 64 +
32 + 32) into the next group's rows (which that group overwrites after, as the groups run
in order); a tile that would run past the last row is moved back inside the rows, the
rows before its own kept as they were. Its gradient is the same loop with the kernels
transposed in the dot (no transposed copy of them), and for the kernels a loop that adds
each tile's x^T dy (the rows outside the group masked) into its group's slice of the
result in place, on x transposed once ([in, M]: each tile a plain [in, t] x [t, out] dot).

On a 2-core AMD EPYC (CPU time of one core, 2,048 tokens, d_model 512), against the
version before (tiles of 256 then 32, the rows padded by a tile for the run-past, the
kernel gradient's dot contracting the rows' first axis): forward, input gradient and
kernel gradient 0.84-0.94x the time at the Mixtral shape (8 groups, 512 x 1408) and at
Qwen3-MoE's (32, 512 x 352); they are 1.04-1.11x (Mixtral) and 1.04-1.3x (Qwen3-MoE) one
plain dot of the same FLOPs, the kernel gradient the slowest (its per-tile sums; adding
them into the result in place, rather than into a sum of each group's copied in after,
took it to 0.96-0.97x at both shapes: docs/performance.md). The loops' own cost is copies
(each tile's dot written into the rows, the kernel of each group sliced, the output's
zeros), about 10% of a layer's step in the profile.

`grouped_matmul` picks tiles on CPU and ragged_dot elsewhere; both are tested against
the definition (tests/moe/test_experts.py, tests/moe/test_grouped_cpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def ragged_dot(x, kernel, sizes, transpose: bool = False):
    """x [M, in] (rows sorted by group), kernel [G, in, out], sizes [G] -> [M, out];
    transpose: kernel [G, out, in], each group's transposed."""
    kernel = jnp.swapaxes(kernel, 1, 2) if transpose else kernel
    return jax.lax.ragged_dot(x, kernel.astype(x.dtype), sizes)


def tile_sizes(m: int, groups: int) -> tuple[int, ...]:
    """The tiles' rows, largest first: powers of two from the largest not over the mean
    group (m / groups) down to 32, none longer than the rows. A group's size in binary:
    one dot per size (the largest as often as it fits), then 32-row tiles for the rest."""
    top = max(32, 1 << max(0, (m // max(groups, 1)).bit_length() - 1))
    return tuple(t for t in (1 << i for i in range(top.bit_length() - 1, 4, -1))
                 if t <= m) or (m,)


def _dot(x, kernel, transpose: bool):
    """x [T, in] times kernel [in, out] (transpose: kernel [out, in], transposed)."""
    return jax.lax.dot_general(x, kernel, (((1,), (1 if transpose else 0,)), ((), ())))


def _tiles_from(step, carry, start, size, t: int, lo, hi, last: bool):
    """carry = step(...) over the tiles lo..hi of t rows from start (_each_tile)."""
    def body(j, c):
        return step(c, start + j * t, t, size - j * t, last)
    return jax.lax.fori_loop(lo, hi, body, carry)


def _each_tile(step, carry, start, size, sizes):
    """carry = step(carry, row, t, left, last) over the tiles of rows [start, start + size):
    tiles of sizes[0] rows while whole ones fit, then sizes[1], ...; one more tile of a
    size runs past the rest where the rest is within sizes[-1] rows of it (one dot for
    what smaller tiles would run past as much), and the last size covers the rest, its
    final tile running past it. row: the tile's first row; left: the rows from row on
    that are the run's; last: whether the tile may run past."""
    for i, t in enumerate(sizes):
        whole = size // t
        if i == len(sizes) - 1:
            past = (size % t > 0).astype(whole.dtype)
        else:
            past = (size % t > t - sizes[-1]).astype(whole.dtype)
        carry = _tiles_from(step, carry, start, size, t, 0, whole, False)
        carry = _tiles_from(step, carry, start, size, t, whole, whole + past, True)
        covered = jnp.minimum(size, (whole + past) * t)
        start, size = start + covered, size - covered
    return carry


def _inside(row, t: int, m: int, last: bool):
    """A tile's first row: row, or for a tile of the last size (which may run past the
    group's end) moved back so that its t rows lie inside the m rows."""
    return jnp.minimum(row, m - t) if last else row


def _zeros(shape, dtype, sizes, *inputs):
    """Zeros for a loop to write into, tied to the loop's own inputs so that XLA neither
    folds them into a constant nor shares one buffer of them between loops: a shared one
    it copies for each loop that writes into it (7 copies of 8-23 MB in the experts'
    gradient at the Mixtral shape: about 1% of its time, docs/performance.md)."""
    tie = sum(a.reshape(-1)[0].astype(dtype) for a in inputs)
    return jnp.broadcast_to(jnp.where(sizes[0] < 0, tie, jnp.zeros((), dtype)), shape)


def _product(x, kernel, sizes, transpose: bool = False):
    """tiles' loop: each group's rows of x times its kernel, written in place; a tile moved
    back inside the rows (_inside) keeps the rows before its own as they were."""
    m, g = x.shape[0], kernel.shape[0]
    tiles = tile_sizes(m, g)
    starts = jnp.cumsum(sizes) - sizes

    def group(e, out):
        w = kernel[e].astype(x.dtype)  # read once per group

        def step(out, row, t, left, last):
            at = _inside(row, t, m, last)
            y = _dot(jax.lax.dynamic_slice_in_dim(x, at, t), w, transpose)  # [t, out]
            if last:
                old = jax.lax.dynamic_slice_in_dim(out, at, t)
                y = jnp.where((at + jnp.arange(t) >= row)[:, None], y, old)
            return jax.lax.dynamic_update_slice_in_dim(out, y, at, 0)
        return _each_tile(step, out, starts[e], sizes[e], tiles)

    out = _zeros((m, kernel.shape[1 if transpose else 2]), x.dtype, sizes, x, kernel)
    return jax.lax.fori_loop(0, g, group, out)


def _kernel_grad(x, dy, sizes):
    """[G, in, out]: each group's x^T dy, each tile's product added into its group's slice
    of the result in place, the rows a tile holds outside its group masked (in the narrower
    of x and dy). x is transposed once [in, M] so that each tile's product is a plain
    [in, t] x [t, out] dot."""
    m, g = x.shape[0], sizes.shape[0]
    tiles = tile_sizes(m, g)
    xt = x.T  # [in, M]
    starts = jnp.cumsum(sizes) - sizes
    mask_x = x.shape[1] <= dy.shape[1]

    def group(e, dk):
        def step(dk, row, t, left, last):
            at = _inside(row, t, m, last)
            a = jax.lax.dynamic_slice_in_dim(xt, at, t, axis=1)  # [in, t]
            b = jax.lax.dynamic_slice_in_dim(dy, at, t)  # [t, out]
            if last:
                i = at + jnp.arange(t)
                keep = (i >= row) & (i < row + left)
                a, b = (jnp.where(keep[None], a, 0), b) if mask_x else \
                    (a, jnp.where(keep[:, None], b, 0))
            return dk.at[e].add(a @ b)  # no sum of its own to start from zeros and copy in
        return _each_tile(step, dk, starts[e], sizes[e], tiles)

    dk = _zeros((g, x.shape[1], dy.shape[1]), dy.dtype, sizes, x, dy)
    return jax.lax.fori_loop(0, g, group, dk)


def _gathered(x, kernel, sizes, transpose: bool):
    """Decoding (no more rows than groups): each row times its own kernel, gathered (only
    the chosen ones read)."""
    group = jnp.repeat(jnp.arange(kernel.shape[0]), sizes, total_repeat_length=x.shape[0])
    return jnp.einsum("mi,mio->mo" if not transpose else "mi,moi->mo", x,
                      kernel[group].astype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiles(x, kernel, sizes, transpose):
    return _product(x, kernel, sizes, transpose)


def _tiles_fwd(x, kernel, sizes, transpose):
    return _product(x, kernel, sizes, transpose), (x, kernel, sizes)


def _tiles_bwd(transpose, saved, dy):
    x, kernel, sizes = saved
    sizes = jnp.asarray(sizes)  # constant sizes may come back as NumPy (a re-traced jaxpr's)
    dx = _product(dy, kernel, sizes, not transpose)
    dk = _kernel_grad(dy, x, sizes) if transpose else _kernel_grad(x, dy, sizes)
    return dx, dk.astype(kernel.dtype), None


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def tiles(x, kernel, sizes, transpose: bool = False):
    """As ragged_dot, by a loop over each group's tiles of rows (the module docstring)."""
    if x.shape[0] <= kernel.shape[0]:
        return _gathered(x, kernel, sizes, transpose)
    return _tiles(x, kernel, sizes, transpose)


GROUPED_MATMULS = {"ragged_dot": ragged_dot, "tiles": tiles}


def grouped_matmul(x, kernel, sizes, impl: str | None = None, transpose: bool = False):
    """x [M, in] sorted by group, kernel [G, in, out], sizes [G] (summing to M) -> [M, out];
    transpose: kernel [G, out, in], each group's transposed in the product. impl: a
    GROUPED_MATMULS name (None: tiles on CPU, ragged_dot elsewhere)."""
    if impl is None:
        impl = "tiles" if jax.default_backend() == "cpu" else "ragged_dot"
    return GROUPED_MATMULS[impl](x, kernel, sizes, transpose)  # each widens the kernel
