"""The grouped matmul of a mixture of experts: rows sorted by group (expert), each group
multiplied by its own kernel. Two ways, as a table (GROUPED_MATMULS):

- ragged_dot: jax.lax.ragged_dot, XLA's grouped matmul (GPU and TPU kernels).
- tiles: a loop over the groups, each reading its kernel once, and inside it a loop of
  2-D dots over tiles of the group's rows, in place (tile_sizes). XLA:CPU lowers
  ragged_dot as a dense dot of every row with every group's kernel, masked (E times the
  work: on a 2-core AMD EPYC, 2048 x 2 rows, 8 experts of 512 x 1408, 820 ms forward
  against 27 ms for one dense matmul of the rows).

tiles reads and writes the sorted rows where they are: a group's rows go in tiles of the
first size while whole ones fit, then the next size, the last size's final tile running
past the group's end into the next group's rows (which that group overwrites after, as
the groups run in order) or into tile_sizes[-1] rows of padding. Its gradient is the
same loop with the kernels transposed in the dot (no transposed copy of them), and for
the kernels a loop that sums each group's x^T dy over its tiles (the run-past rows
masked) and writes it once. Against the first version (each group padded into whole
tiles of 128 rows, built by a scatter; a loop over every tile, the all-zero ones too,
slicing the tile's kernel; the kernel gradient added into an [E, in, out] carry each
tile, which XLA copied), with jaxformer.moe.experts's gathers in place of scatters, the layer's
forward and gradient (2048 tokens, d_model 512) took 0.80x the time at the Mixtral
shape (8 experts top-2, width 1408) and 0.75x at Qwen3-MoE's (32 top-4, 352); the
4-layer train step (bench/moe.py) 0.77x and 0.64x. The loops' dots now run near a plain
dot's rate (tiles of 128 or more rows at 90-100% of it, 32 rows at 70-85%); the layer
stays 1.2x (Mixtral) and 1.4x (Qwen3-MoE) a dense FFN of the same FLOPs: the loops
(ragged groups) 20-30%, the sorting and weighting 5-17%. Tile sizes barely matter: at
the Qwen3-MoE shape 256 then 32, 128 then 32, 128 then 16, 256 then 64, 128/64/16 and
64 alone were within 5%, and a version without the padding (a last tile moved back
inside the rows, its write masked) within noise of this one.

`grouped_matmul` picks tiles on CPU and ragged_dot elsewhere; both are tested against
the definition (tests/moe/test_experts.py).
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
    """The tiles' rows, largest first: 256 while whole ones fit, then 32 (2048 x 2 rows
    at 8 groups and 2048 x 4 at 32 measured against 128 alone, 64 alone, 512 then 64),
    none longer than the rows."""
    return tuple(t for t in (256, 32) if t <= m) or (m,)


def _dot(x, kernel, transpose: bool):
    """x [T, in] times kernel [in, out] (transpose: kernel [out, in], transposed)."""
    return jax.lax.dot_general(x, kernel, (((1,), (1 if transpose else 0,)), ((), ())))


def _each_tile(step, carry, start, size, sizes):
    """carry = step(carry, row, t, left, last) over the tiles of rows [start, start + size):
    tiles of sizes[0] rows while whole ones fit, then sizes[1], ...; the last size covers
    the rest, its final tile running past it. row: the tile's first row; left: the rows
    from row on that are the run's; last: whether a tile of this size may run past."""
    for i, t in enumerate(sizes):
        last = i == len(sizes) - 1
        count = -(-size // t) if last else size // t

        def body(j, c, t=t, last=last, start=start, size=size):
            return step(c, start + j * t, t, size - j * t, last)
        carry = jax.lax.fori_loop(0, count, body, carry)
        start, size = start + count * t, size - count * t
    return carry


def _product(x, kernel, sizes, transpose: bool = False):
    """tiles' loop: each group's rows of x times its kernel, written in place."""
    m, g = x.shape[0], kernel.shape[0]
    tiles = tile_sizes(m, g)
    xp = jnp.pad(x, ((0, tiles[-1]), (0, 0)))  # the last group's last tile runs past m
    starts = jnp.cumsum(sizes) - sizes

    def group(e, out):
        w = kernel[e].astype(x.dtype)  # read once per group

        def step(out, row, t, left, last):
            y = _dot(jax.lax.dynamic_slice_in_dim(xp, row, t), w, transpose)
            return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)
        return _each_tile(step, out, starts[e], sizes[e], tiles)

    out = jnp.zeros((xp.shape[0], kernel.shape[1 if transpose else 2]), x.dtype)
    return jax.lax.fori_loop(0, g, group, out)[:m]


def _kernel_grad(x, dy, sizes):
    """[G, in, out]: each group's x^T dy, summed over its tiles, the rows a tile runs past
    its group masked (in the narrower of x and dy)."""
    g = sizes.shape[0]
    tiles = tile_sizes(x.shape[0], g)
    xp, dyp = (jnp.pad(a, ((0, tiles[-1]), (0, 0))) for a in (x, dy))
    starts = jnp.cumsum(sizes) - sizes
    mask_x = x.shape[1] <= dy.shape[1]

    def group(e, dk):
        def step(acc, row, t, left, last):
            a = jax.lax.dynamic_slice_in_dim(xp, row, t)
            b = jax.lax.dynamic_slice_in_dim(dyp, row, t)
            if last:
                keep = jnp.arange(t)[:, None] < left
                a, b = (jnp.where(keep, a, 0), b) if mask_x else (a, jnp.where(keep, b, 0))
            return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())))
        acc = jnp.zeros(dk.shape[1:], dk.dtype)
        acc = _each_tile(step, acc, starts[e], sizes[e], tiles)
        return jax.lax.dynamic_update_index_in_dim(dk, acc, e, 0)

    dk = jnp.zeros((g, x.shape[1], dy.shape[1]), dy.dtype)
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
