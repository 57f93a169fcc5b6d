"""jaxformer.core.hooks on a two-line Flax module: without a session hook_point returns
its input and the program is the plain one; inside a session a hook replaces the value
(what follows computes from it), the kept names are recorded, active() reports what the
session wants, and unknown names or a hook returning another shape are refused in one line."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.core.hooks import active, hook_name, hook_point, session


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return hook_point(self, "hook_out", 2.0 * hook_point(self, "hook_in", x))


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.sow("intermediates", "active", active(self, "hook_x", "hook_y"))
        y = Inner(name="block_3")(hook_point(self, "hook_x", x))
        return Inner(name="ffn")(y) + 1.0


def test_hook_name_is_transformer_lens_naming():
    assert hook_name(("block_3", "attn"), "hook_q") == "blocks.3.attn.hook_q"
    assert hook_name(("block_12", "ffn"), "hook_post") == "blocks.12.mlp.hook_post"
    assert hook_name(("final_norm",), "hook_scale") == "ln_final.hook_scale"
    assert hook_name((), "hook_embed") == "hook_embed"


def test_no_session_returns_the_input_and_adds_nothing(rng):
    x = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    m = Outer()
    out, state = m.apply({}, x, mutable="intermediates")
    np.testing.assert_allclose(out, 4 * np.asarray(x) + 1, rtol=1e-6)
    assert state["intermediates"]["active"] == (False,)
    plain = jax.make_jaxpr(lambda x: 2.0 * (2.0 * x) + 1.0)(x)
    traced = jax.make_jaxpr(lambda x: m.apply({}, x))(x)
    assert [e.primitive for e in traced.eqns] == [e.primitive for e in plain.eqns]


def test_a_session_replaces_and_records_values(rng):
    x = np.asarray(rng.normal(size=(2, 3)), np.float32)
    shift = np.asarray(rng.normal(size=(2, 3)), np.float32)
    m = Outer()
    with session({"blocks.3.hook_out": lambda v: v + shift},
                 keep=lambda n: n.endswith("hook_in") or n == "hook_x") as s:
        def run(x):  # what a session records are the trace's values: returned from it
            out, state = m.apply({}, x, mutable="intermediates")
            return out, state, dict(s.cache)
        out, state, cache = jax.jit(run)(x)
    # x -> block_3: 2x, replaced by 2x + shift -> mlp: 2 (2x + shift) -> + 1
    np.testing.assert_allclose(out, 2 * (2 * x + shift) + 1, rtol=1e-6)
    assert set(cache) == {"hook_x", "blocks.3.hook_in", "mlp.hook_in"}
    np.testing.assert_allclose(cache["mlp.hook_in"], 2 * x + shift, rtol=1e-6)
    np.testing.assert_allclose(cache["blocks.3.hook_in"], x)
    assert s.seen == {"hook_x", "hook_y", "blocks.3.hook_in", "blocks.3.hook_out",
                      "mlp.hook_in", "mlp.hook_out"}
    assert state["intermediates"]["active"] == (True,)
    with session({}, keep=lambda n: n == "mlp.hook_out") as s:
        _, state = m.apply({}, x, mutable="intermediates")
    assert state["intermediates"]["active"] == (False,) and list(s.cache) == ["mlp.hook_out"]
    with session({}, keep=lambda n: n == "hook_y"):  # any of the names asked about
        _, state = m.apply({}, x, mutable="intermediates")
    assert state["intermediates"]["active"] == (True,)


def test_hooks_compose_with_grad(rng):
    x = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    scale = float(rng.uniform(0.5, 2))
    m = Outer()
    with session({"mlp.hook_in": lambda v: scale * v ** 2}, keep=lambda n: False):
        g = jax.grad(lambda x: m.apply({}, x).sum())(x)
    # out = 2 * scale * (2x)^2 + 1: d/dx = 16 * scale * x
    np.testing.assert_allclose(g, 16 * scale * np.asarray(x), rtol=1e-5)


def test_unknown_names_and_bad_hooks_are_refused_in_one_line(rng):
    x = jnp.ones((2, 3))
    m = Outer()
    with pytest.raises(ValueError) as e:
        with session({"blocks.3.hook_outt": lambda v: v}, keep=lambda n: False):
            m.apply({}, x)
    text = str(e.value)
    assert "\n" not in text and text.startswith("hooks on 'blocks.3.hook_outt' (did you mean "
                                                "'blocks.3.hook_out'?): no such hook point")
    with pytest.raises(ValueError, match=r"^names 'nowhere': no such hook point"):
        with session({}, keep=lambda n: False, names=frozenset({"nowhere"})):
            m.apply({}, x)
    for bad in (lambda v: v[0], lambda v: v.astype(jnp.int32)):
        with pytest.raises(ValueError, match=r"the hook on hook_x must return its input's "
                                             r"shape and dtype \(2, 3\) float32"):
            with session({"hook_x": bad}, keep=lambda n: False):
                m.apply({}, x)
