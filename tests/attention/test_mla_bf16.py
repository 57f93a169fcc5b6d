"""MLA's absorbed decode in bfloat16 on CPU (jaxformer.attention.mla.latent_attention): a
bf16 model's greedy decode at batch 2 runs (XLA:CPU has no bf16 x bf16 -> f32 dot thunk)
and each token's log-prob is near the float32 model's full forward's. Fresh random
weights and prompts every run."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import ModelConfig, Transformer
from jaxformer.attention.mla import wide_einsum
from jaxformer.decode import generate
from tests.conftest import np_log_softmax

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, position="rope",
                  norm="rmsnorm", ffn="swiglu", use_bias=False, tie_embeddings=False,
                  max_seq_len=32, mla=MLA)


def test_wide_einsum_of_bf16_equals_float64():
    """bf16 operands, float32 result: the float64 product of the same bf16 values."""
    a = jnp.asarray(rng.standard_normal((2, 3, 4, 12)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((2, 5, 12)), jnp.bfloat16)
    got = jax.jit(wide_einsum, static_argnums=0)("btnr,bsr->bnts", a, b)
    want = np.einsum("btnr,bsr->bnts", np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_bf16_mla_greedy_decode_at_batch_2_is_near_float32():
    """A bf16 MLA model (compute and params) decodes 2 rows greedily over its latent
    cache; the float32 model's full forward over the same tokens gives each new token a
    log-prob within bf16 error of the decode's."""
    params = jax.jit(Transformer(CFG).init)(jax.random.key(int(rng.integers(1 << 30))),
                                            jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 2.0, params)  # sharper: log-probs far apart
    bf16 = CFG.replace(dtype="bfloat16")
    prompts = rng.integers(1, CFG.vocab_size, (2, 6)).astype(np.int32)
    out = generate(Transformer(bf16), jax.tree.map(lambda x: x.astype(jnp.bfloat16), params),
                   prompts, max_new_tokens=4, rng=jax.random.key(0), temperature=0)
    tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)  # [2, 10]
    logits = jax.jit(Transformer(CFG).apply)({"params": params}, tokens)  # [2, 10, V]
    logp = np_log_softmax(logits)[:, 5:-1]  # position t predicts token t + 1
    want = np.take_along_axis(logp, tokens[:, 6:, None], -1)[..., 0]  # [2, 4]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=0, atol=0.03)
