"""model.arch as a table: each jaxformer.model.archs.ARCHS entry against the models it
builds (jaxformer.model.build.MODELS)."""

import jax
import numpy as np
import pytest

from jaxformer import ConfigError, ModelConfig
from jaxformer.model.archs import ARCHS
from jaxformer.model.build import model_for

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


# what each arch is, written here apart from the table: (causal, generates, module,
# an encoder stack of its own)
EXPECTED = {"decoder": (True, True, "Transformer", False),
            "encoder": (False, False, "Transformer", False),
            "encoder_decoder": (True, True, "EncoderDecoder", True)}


def test_the_table_holds_the_three_shapes():
    assert {n: (a.causal, a.generates, a.module, a.cross_attention)
            for n, a in ARCHS.items()} == EXPECTED


@pytest.mark.parametrize("arch", list(ARCHS))
def test_each_arch_entry_answers_for_its_models(arch):
    """Each arch's models do what it is: built by its module, the causal rule seen in the
    logits (changing the last token moves the first's only without it), generation (an
    encoder's KV cache refused in one line), and an encoder stack of its own in the params
    where it has cross-attention."""
    causal, generates, module, cross = EXPECTED[arch]
    cfg = ModelConfig(arch=arch, vocab_size=61, d_model=16, n_layers=1, n_heads=2,
                      max_seq_len=16, position="t5")
    model = model_for(cfg)
    assert type(model).__name__ == module
    assert (cfg.causal, cfg.generates) == (causal, generates)
    tokens = jax.numpy.asarray(rng.integers(0, 61, (1, 6)))
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    assert ("encoder" in params) == cross
    other = tokens.at[0, -1].set((tokens[0, -1] + 1) % 61)
    if not cross:
        first = [np.asarray(model.apply({"params": params}, t))[0, 0] for t in (tokens, other)]
        assert np.array_equal(*first) == causal
    else:  # the target's first logits see the whole source, none of the target after it
        def first(source, target):
            return np.asarray(model.apply({"params": params}, source, target))[0, 0]
        assert np.array_equal(first(tokens, tokens), first(tokens, other)) == causal
        assert not np.array_equal(first(tokens, tokens), first(other, tokens))
    if not generates:
        from jaxformer.attention.kv_cache import init_cache
        with pytest.raises(ConfigError, match=f"model.arch={arch} has no generation"):
            init_cache(cfg, 1, 8)
