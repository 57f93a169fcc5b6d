"""jaxformer.training.sweep's parts, without a training step (the vmapped sweep trained
against separate runs is tests/model/test_lora.py's): members counts ranks x seeds and
refuses a mixture-of-experts model in one line; sweep_params stacks each member's fresh
adapters, A padded with zero columns past its rank (its first r columns a rank-r model's
with the same seed), B zeros, alpha / r its own, the base once; sweep_specs puts an
unsharded member axis in front of the adapters' specs alone; member_losses gives each
member the loss of its own adapters and scale over the shared base."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from jaxformer import ConfigError, ModelConfig, Transformer
from jaxformer.model.lora import LoRAConfig
from jaxformer.training.sweep import member_losses, members, sweep_params, sweep_specs


def stand_in(sparse=(False, False), **lora):
    return types.SimpleNamespace(cfg=types.SimpleNamespace(lora=LoRAConfig(**lora),
                                                           sparse_layers=sparse))


def test_members_is_ranks_times_seeds_and_refuses_a_moe_sweep():
    assert members(stand_in(rank=4)) == 1 and members(stand_in()) == 1
    assert members(stand_in(sweep_rank=(2, 4, 8))) == 3
    assert members(stand_in(sweep_rank=(2, 4), sweep_seeds=3)) == 6
    assert members(stand_in(rank=2, sweep_seeds=5)) == 5
    assert members(stand_in((False, True), rank=4)) == 1  # one adapter of a MoE model: fine
    with pytest.raises(ConfigError) as e:
        members(stand_in((False, True), rank=2, sweep_seeds=2))
    assert "\n" not in str(e.value) and "mixture-of-experts model (model.moe.experts > 0)" \
        in str(e.value)


@pytest.mark.parametrize("scan, seeds", [(False, 2), (True, 1)])
def test_sweep_params_pad_each_members_adapters_to_the_largest_rank(rng, scan, seeds):
    alpha, ranks = float(rng.uniform(1, 16)), (1, 3)
    cfg = ModelConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                      scan_layers=scan, lora={"sweep_rank": ranks, "sweep_seeds": seeds,
                                              "alpha": alpha, "targets": ("query", "out")})
    tokens = jnp.asarray(rng.integers(0, 29, (1, 5)))
    key = jax.random.key(int(rng.integers(1 << 30)))
    init = lambda c, key: Transformer(c).init(key, tokens)["params"]  # noqa: E731
    got = flatten_dict(sweep_params(Transformer(cfg), key, tokens))
    plain = flatten_dict(init(cfg.replace(lora=LoRAConfig(rank=0)), key))
    assert {k for k in got if k[-1].startswith("lora")} and \
        {k for k in got if not k[-1].startswith("lora")} == set(plain)
    for k, v in plain.items():  # the base: once, as a model without adapters draws it
        np.testing.assert_array_equal(got[k], v, err_msg=str(k))
    # members (1, 0), (1, 1), (3, 0), (3, 1) by (rank, seed); or (1, 0), (3, 0)
    for i, r, seed in [(1, 1, 1), (2, 3, 0)] if seeds == 2 else [(0, 1, 0), (1, 3, 0)]:
        alone = flatten_dict(init(cfg.replace(lora=LoRAConfig(
            rank=r, seed=seed, alpha=alpha, targets=("query", "out"))), key))
        for k, v in alone.items():
            x, leaf = np.asarray(got[k][i]), k[-1]
            if leaf == "lora_scale":
                np.testing.assert_allclose(x, alpha / r, rtol=1e-6)
            elif leaf == "lora_a":  # [L.., in..., 3]: its first r columns, then zeros
                np.testing.assert_array_equal(x[..., :r], v, err_msg=str(k))
                assert x.shape[-1] == 3 and not x[..., r:].any()
            elif leaf == "lora_b":  # [L.., 3, out...]: zeros, as B starts
                assert x.shape[int(scan)] == 3 and not x.any() and not np.asarray(v).any()
        assert {k for k in got if k[-1].startswith("lora")} == \
            {k for k in alone if k[-1].startswith("lora")}


def test_sweep_specs_put_the_member_axis_in_front_of_the_adapters_alone():
    specs = {"attn": {"query": {"kernel": P("embed", "heads", None)},
                      "query_lora": {"lora_a": P("embed", "lora_rank"),
                                     "lora_b": P("lora_rank", "heads", None),
                                     "lora_scale": P()}},
             "norm": {"scale": P("embed")}}
    got = sweep_specs(specs)
    assert got == {"attn": {"query": {"kernel": P("embed", "heads", None)},
                            "query_lora": {"lora_a": P(None, "embed", "lora_rank"),
                                           "lora_b": P(None, "lora_rank", "heads", None),
                                           "lora_scale": P(None)}},
                   "norm": {"scale": P("embed")}}


def test_member_losses_give_each_member_its_own_adapters_and_scale(rng):
    s, d, r = 3, 4, 2
    a, b = rng.normal(size=(s, d, r)), rng.normal(size=(s, r, d))
    scales, w, x = rng.uniform(0.5, 2, size=s), rng.normal(size=(d, d)), rng.normal(size=(5, d))
    trained = {"p_lora": {"lora_a": jnp.asarray(a, jnp.float32),
                          "lora_b": jnp.asarray(b, jnp.float32)}}
    frozen = {"p": {"kernel": jnp.asarray(w, jnp.float32)},
              "p_lora": {"lora_scale": jnp.asarray(scales, jnp.float32)}}

    def loss_fn(params):
        p, q = params["p"], params["p_lora"]
        y = x @ (p["kernel"] + q["lora_scale"] * q["lora_a"] @ q["lora_b"])
        return jnp.sum(y ** 2), jnp.asarray(5)

    totals, count = member_losses(loss_fn, trained, frozen)
    want = [np.sum((x @ (w + scales[i] * a[i] @ b[i])) ** 2) for i in range(s)]
    np.testing.assert_allclose(totals, want, rtol=1e-5)
    assert totals.shape == (s,) and int(count) == 5
