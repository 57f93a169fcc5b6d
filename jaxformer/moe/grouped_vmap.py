"""A grouped matmul that jax.vmap batches over its rows alone.

A grouped matmul (rows sorted by group, each group's rows times its own kernel:
jaxformer.moe.grouped_matmul) batches under jax.vmap only where its parts do:
jax.lax.ragged_dot needs its rows, kernels and group sizes all batched ("ragged_dot vmap
over any dim but 0 - NYI"), and a model vmapped over its rows (speculative decoding
verifies each row in its own cache) has batched rows and group sizes but one set of
kernels. `over_rows(matmul)` runs a batch as one call of `matmul`: with one kernel, the
batch's rows re-sorted by group (each kernel read once); with a kernel per batch entry,
the batch's groups side by side (B * G groups, rows in their order). Its gradient is a
custom_vjp whose two products batch the same way (custom_vmap alone has no reverse
mode), so vmap of grad and grad of vmap hold; jax.jvp is not defined through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _batched_all(axis_size, in_batched, args):
    """args with every unbatched one broadcast to the batch (rows and sizes, or the
    activations of a gradient: never a kernel that no vmap batches)."""
    return [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(args, in_batched)]


def _resorted(h, sizes, n_groups: int):
    """Rows h [B, M, in] (each batch's sorted by group, sizes [B, G]) as one run sorted by
    group: (rows [B M, in], the order taken [B M], sizes [G])."""
    b, m = h.shape[:2]
    ends = jnp.cumsum(sizes, axis=-1)  # [B, G]
    group = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(m), side="right"))(ends)
    flat = group.reshape(-1)  # [B M]: each row's group
    order = jnp.argsort(flat, stable=True)
    total = jnp.bincount(flat, length=n_groups).astype(sizes.dtype)  # [G]
    return h.reshape(b * m, -1)[order], order, total


def _batched_product(matmul):
    """matmul(h, kernel, sizes) as a custom_vmap: a batch of rows re-sorted into one call
    (one kernel), or the batch's groups side by side (a kernel per batch entry)."""

    def side_by_side(fn, h, kernel, sizes):  # all batched: B * G groups, one call
        b, m = h.shape[:2]
        y = fn(h.reshape(b * m, -1), kernel.reshape(-1, *kernel.shape[2:]), sizes.reshape(-1))
        return y.reshape(b, m, -1)

    @jax.custom_batching.custom_vmap
    def product(h, kernel, sizes):
        return matmul(h, kernel, sizes)

    @product.def_vmap
    def product_batched(axis_size, in_batched, h, kernel, sizes):
        if in_batched[1]:  # a kernel per batch entry
            return side_by_side(product, *_batched_all(axis_size, in_batched,
                                                       (h, kernel, sizes))), True
        h, _, sizes = _batched_all(axis_size, in_batched, (h, kernel, sizes))
        rows, order, total = _resorted(h, sizes, kernel.shape[0])
        y = product(rows, kernel, total)[jnp.argsort(order)]  # [B M, out], rows' order
        return y.reshape(*h.shape[:2], -1), True

    return product


def over_rows(matmul):
    """matmul(h [M, in], kernel [G, in, out], sizes [G] summing to M, transpose=False) ->
    [M, out] (transpose: kernel [G, out, in], transposed in the product), as one that vmap
    batches whichever of h, kernel and sizes it batches. Make it once per matmul, as a
    module's constant (jaxformer.moe.experts.GROUPED): made and dropped in a loop, a later one
    gave wrong answers under vmap (a traced rule of a collected one, seemingly). The
    gradient's product with the transposed kernels is matmul's transpose=True (no
    transposed copy of the kernels)."""
    product = _batched_product(matmul)
    product_t = _batched_product(lambda h, kernel, sizes: matmul(h, kernel, sizes,
                                                                 transpose=True))

    @jax.custom_batching.custom_vmap
    def kernel_grad(h, g, sizes):  # sum over each group's rows of h^T g: [G, in, out]
        zeros = jnp.zeros((sizes.shape[0], h.shape[-1], g.shape[-1]), g.dtype)
        return jax.vjp(lambda k: matmul(h, k, sizes), zeros)[1](g)[0]

    @kernel_grad.def_vmap
    def kernel_grad_batched(axis_size, in_batched, h, g, sizes):  # B * G groups, one call
        h, g, sizes = _batched_all(axis_size, in_batched, (h, g, sizes))
        b, n_groups = sizes.shape
        dk = kernel_grad(h.reshape(-1, h.shape[-1]), g.reshape(-1, g.shape[-1]),
                         sizes.reshape(-1))  # [B G, in, out]
        return dk.reshape(b, n_groups, *dk.shape[1:]), True

    @jax.custom_vjp
    def grouped(h, kernel, sizes):
        return product(h, kernel, sizes)

    def forward(h, kernel, sizes):
        return product(h, kernel, sizes), (h, kernel, sizes)

    def backward(res, g):
        h, kernel, sizes = res
        dh = product_t(g, kernel, sizes)  # [M, in]
        return dh, kernel_grad(h, g, sizes).astype(kernel.dtype), None

    grouped.defvjp(forward, backward)
    return grouped
