"""Runs in a subprocess with 8 fake CPU devices (tests/core/test_low_precision.py starts it):
python -m tests.core.low_precision_worker OUT_JSON PRECISION [PRECISION ...]. The loss and
gradients of a model in each model.matmul_precision given (tests/core/mesh_worker.py's,
scanned) on one device and on a (data 2, fsdp 2, tensor 2) mesh, params and batch split
over it, and in float32 on one device (each recipe's own effect, for scale), as JSON."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer.core.sharding import make_mesh, traced_under  # noqa: E402
from jaxformer.training.step import logits_of  # noqa: E402
from tests.core import mesh_worker  # noqa: E402


def loss_and_grads(mesh):
    model, _, state, _, place = mesh_worker.setup(mesh)
    batch = place(mesh_worker.batches()[0])

    def loss(params):
        logits, b = logits_of(model, params, batch)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * b["loss_mask"]) / jnp.sum(b["loss_mask"])
    value, grads = jax.jit(traced_under(mesh, mesh_worker.RULES, jax.value_and_grad(loss)))(
        state.params)
    flat = np.concatenate([np.asarray(v).ravel() for v in mesh_worker.flat(grads).values()])
    return dict(loss=float(value), grads=flat.tolist())


if __name__ == "__main__":
    res, base = dict(float32=loss_and_grads(None), devices=len(jax.devices())), mesh_worker.CFG
    for precision in sys.argv[2:]:
        mesh_worker.CFG = base.replace(matmul_precision=precision)
        res[precision] = dict(one=loss_and_grads(None), mesh=loss_and_grads(make_mesh(2, 2, 2)))
    json.dump(res, open(sys.argv[1], "w"))
