"""model.loss_chunk across the objectives table (jaxformer.training.objectives): an entry
whose hooks chunk their loss (Objective.loss_chunk: every entry today) takes it, one
without it refuses it at config time in one line naming the objective and the setting,
never training silently on the whole logits. Parametrised over the table, so an objective
added later is checked too. MLM's chunked loss: its value and gradient equal the plain
one's, and its compiled gradient holds no [B, T, V] logits; the pair objectives' gradient
holds none either."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, objectives
from jaxformer.training.chunked_loss import ChunkedLanguageModel
from jaxformer.training.mlm import MaskedLM
from tests.training.test_chunked_loss import largest_buffer
from tests.training.test_objectives import needs, run  # noqa: F401  (run: a fixture)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


@pytest.mark.parametrize("own", [True, False], ids=["as-is", "without-it"])
@pytest.mark.parametrize("name", list(objectives.OBJECTIVES))
def test_loss_chunk_is_taken_or_refused_by_each_objective(name, own, run,  # noqa: F811
                                                          monkeypatch):
    """Each entry as it is, and the same entry with loss_chunk false (as an objective added
    without it would be)."""
    if not own:
        monkeypatch.setitem(objectives.OBJECTIVES, name, dataclasses.replace(
            objectives.OBJECTIVES[name], loss_chunk=False))
    args = [*needs(name, run), f"objective.name={name}", "model.loss_chunk=8"]
    if not objectives.OBJECTIVES[name].loss_chunk:
        with pytest.raises(ConfigError) as err:
            load_config(None, args)
        message = str(err.value)
        assert "\n" not in message
        takes = ", ".join(n for n, e in objectives.OBJECTIVES.items() if e.loss_chunk)
        for words in (f"model.loss_chunk=8 with objective.name={name}",
                      f"model.loss_chunk chunks objective.name {takes};"):
            assert words in message, message
        load_config(None, args[:-1])  # the same run without it loads
        return
    cfg = load_config(None, args)
    assert cfg.train.loss_chunk == 8
    assert getattr(objectives.build(cfg), "chunk", None) == 8  # its hooks chunk by 8


def test_a_fine_tune_from_weights_takes_loss_chunk(run):  # noqa: F811
    """SFT (lm on prompt/completion records, from train.init_from's model) chunks its loss:
    model.loss_chunk moves to train before init_from's model fills the model section."""
    cfg = load_config(None, ["data.format=prompt_completion", "data.path=p.jsonl",
                             f"train.init_from={run}", "model.loss_chunk=8"])
    assert cfg.train.loss_chunk == 8 and cfg.model.d_model == 32  # the run's model
    assert isinstance(objectives.build(cfg), ChunkedLanguageModel)


def test_mlm_chunked_loss_equals_the_plain_one_without_full_logits():
    """A BERT-like encoder (head transform and its norm, tied head with a bias): the masked
    loss and its gradient in blocks of 8 of T = 32 (the same corruption key) equal the
    plain loss's within float32 rounding; the chunked gradient's compiled program has no
    float32 array of B x T x V elements (test_chunked_loss: the check sees a plain one's)."""
    b, t, v = 2, 32, 256
    cfg = load_config(None, ["model.arch=encoder", "objective.name=mlm", "model.d_model=16",
                             "model.n_layers=1", "model.n_heads=2", f"model.max_seq_len={t}",
                             f"model.vocab_size={v}", "model.head_transform=true",
                             "model.head_bias=true", "objective.mask_rate=0.5",
                             "model.loss_chunk=8"])
    model, chunked = Transformer(cfg.model), MaskedLM.of(cfg)
    plain = MaskedLM(chunked.rate, chunked.mask_id, chunked.vocab_size)
    tokens = jnp.asarray(rng.integers(0, v - 1, (b, t)), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "loss_mask": jnp.ones((b, t), jnp.float32)}
    params = jax.jit(model.init)(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    key = jax.random.key(int(rng.integers(1 << 30)))

    def value_and_grad(obj):
        return jax.jit(jax.value_and_grad(lambda p: obj.terms(model, p, batch, key)[0]))

    (got, got_grad), (want, want_grad) = (value_and_grad(o)(params) for o in (chunked, plain))
    np.testing.assert_allclose(float(got), float(want), rtol=2e-6)
    for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(got_grad),
                            jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6, err_msg=str(path))
    grad = jax.grad(lambda p: chunked.terms(model, p, batch, key)[0])
    assert largest_buffer(grad, params) < b * t * v // 2  # the plain loss's has b t v


@pytest.mark.parametrize("name", [n for n, e in objectives.OBJECTIVES.items()
                                  if e.loss_chunk and "pairs" in e.batches.get("decoder", ())])
def test_a_pair_objectives_chunked_gradient_holds_no_full_logits(name):
    """dpo and orpo with model.loss_chunk=16 (T = 64, two answers a row): the compiled
    gradient of the step's loss (the reference's log-probs included) has no float32 array of
    B x T x V elements (test_chunked_loss: the check sees a plain one's); their values
    against float64: tests/training/test_dpo.py, test_odds_ratio.py."""
    b, t, v = 2, 64, 512
    model = Transformer(ModelConfig(vocab_size=v, d_model=16, n_layers=1, n_heads=2,
                                    max_seq_len=t))
    entry = objectives.OBJECTIVES[name]
    hooks = entry.build(types.SimpleNamespace(objective=entry.settings(),
                                              train=types.SimpleNamespace(loss_chunk=16)), None)
    half = t // 2
    batch = {"inputs": jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
             "loss_mask": jnp.ones((b, t), jnp.float32),
             "segment_ids": jnp.asarray(np.repeat([[1] * half + [2] * half], b, 0), jnp.int32),
             "positions": jnp.asarray(np.tile(np.arange(half), (b, 2)), jnp.int32)}
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"]))["params"]
    grads = lambda p: hooks.gradient_sums(model, p, {}, batch, None, reference=p)[2]  # noqa: E731
    assert hooks.chunk == 16
    assert largest_buffer(grads, params) < b * t * v // 2
