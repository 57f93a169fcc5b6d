"""ModelConfig (jaxformer.model.config): its checks and one-line errors, derived fields and the
released configurations it reads (jaxformer.model.presets)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer
from jaxformer import ConfigError, ModelConfig, RopeScaling
from jaxformer.model.config import PRESETS


def test_none_fields_resolve():
    cfg = ModelConfig(d_model=96, n_heads=6, ffn="gelu")
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (6, 16, 384)
    gated = ModelConfig(d_model=96, n_heads=6, ffn="swiglu")
    assert gated.d_ff == 256  # 8/3 * 96 = 256, already a multiple of 64
    assert ModelConfig(d_model=100, n_heads=5, ffn="geglu").d_ff == 320  # 266.7 -> 320


def test_frozen_and_hashable():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 8
    assert hash(cfg) == hash(ModelConfig())


@pytest.mark.parametrize("kwargs, words", [
    (dict(d_model=100, n_heads=3), ["d_model=100", "n_heads=3", "head_dim"]),
    (dict(n_heads=6, n_kv_heads=4, d_model=96), ["n_heads=6", "n_kv_heads=4"]),
    (dict(d_model=96, n_heads=4, head_dim=7), ["head_dim=7", "odd", "RoPE"]),
    (dict(d_model=33, n_heads=1, position="sinusoidal"), ["d_model=33", "sinusoidal"]),
    (dict(position="rotary"), ["position='rotary'", "rope", "alibi", "sinusoidal", "learned",
                               "none", "t5", "fire"]),
    (dict(position="sinusoidal", position_settings={"scale": "vaswani"}),
     ["model.position_settings.scale='vaswani'", "table", "tokens", "unit"]),
    (dict(position="t5", position_settings={"num_buckets": 32, "max_distance": 16}),
     ["position_settings.max_distance=16", "position_settings.num_buckets=32"]),
    (dict(position="t5", position_settings={"num_buckets": 2}),
     ["position_settings.num_buckets=2", ">= 4"]),
    (dict(position="cope", position_settings={"positions": 1}),
     ["position_settings.positions=1", ">= 2"]),
    (dict(position="t5", position_settings={"scale": "tokens"}),
     ["position_settings.scale is not a setting of position='t5'", "num_buckets, max_distance"]),
    (dict(position="alibi", position_settings={"num_buckets": 8}),
     ["position_settings.num_buckets is not a setting of position='alibi'", "it has none"]),
    (dict(norm="batchnorm"), ["norm='batchnorm'", "layernorm", "rmsnorm"]),
    (dict(block="sideways"), ["block='sideways'", "pre_ln", "post_ln", "sandwich", "parallel"]),
    (dict(ffn="swish"), ["ffn='swish'", "gelu", "relu", "swiglu", "geglu"]),
    (dict(remat="some"), ["remat='some'", "none", "full", "dots"]),
    (dict(attention_impl="flash"), ["attention_impl='flash'", "reference", "xla", "cudnn"]),
    (dict(dtype="fp8"), ["dtype='fp8'", "bfloat16"]),
    (dict(dropout=1.0), ["dropout=1.0", "< 1"]),
    (dict(d_model=0), ["d_model=0", ">= 1"]),
    (dict(n_layers="4"), ["n_layers='4'", "int"]),
    (dict(sliding_window=0), ["sliding_window=0"]),
    (dict(scan_layers="yes"), ["scan_layers", "true or false"]),
    (dict(position="alibi", rope_scaling="linear"), ["rope_scaling", "position='rope'"]),
    (dict(rope_scaling=dict(kind="yarn", factor=0.5)), ["factor=0.5", ">= 1"]),
    (dict(rope_scaling=dict(kind="xpos")), ["kind='xpos'", "linear", "ntk", "yarn", "llama3"]),
    (dict(rope_scaling=dict(kind="linear", scale=2)), ["unknown rope_scaling field", "scale",
                                                        "factor"]),
])
def test_bad_values_name_field_and_choices(kwargs, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_from_dict_rejects_unknown_keys_and_round_trips():
    with pytest.raises(ConfigError, match="unknown model field.*d_modle.*valid fields are:.*d_model"):
        ModelConfig.from_dict({"d_modle": 64})
    cfg = ModelConfig.preset("llama3.1-8b")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown model field"):
        cfg.replace(n_layer=2)
    assert cfg.replace(n_layers=2).n_layers == 2


@pytest.mark.parametrize("name,fields", [("lora", "rank, alpha"), ("moe", "experts, top_k"),
                                         ("mla", "q_lora_rank, kv_lora_rank")])
def test_an_empty_or_scalar_nested_section_is_one_line(name, fields):
    """`lora:` with every key commented out in YAML is None; model.lora=5 a string."""
    for value in (None, 5, "5", [1]):
        with pytest.raises(ConfigError) as e:
            ModelConfig(**{name: value})
        assert str(e.value) == (f"model.{name} must be a mapping of its fields ({fields}, ...); "
                                f"got {value!r}")
    assert ModelConfig(**{name: {}}) == ModelConfig()  # an empty mapping: the defaults


def test_rope_scaling_forms():
    assert ModelConfig(rope_scaling="linear").rope_scaling == RopeScaling(kind="linear")
    cfg = ModelConfig(max_seq_len=512, rope_scaling={"kind": "yarn", "factor": 4.0})
    assert cfg.rope_scaling.original_max_seq_len == 512  # the training length by default
    with pytest.raises(ConfigError, match="high_freq_factor"):
        RopeScaling(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_presets():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'.*gpt2-small"):
        ModelConfig.preset("gpt5")
    for name in PRESETS:
        assert isinstance(ModelConfig.preset(name), ModelConfig)
    llama = ModelConfig.preset("llama3-8b")
    assert (llama.n_kv_heads, llama.rope_theta, llama.ffn, llama.norm, llama.tie_embeddings) == \
        (8, 500000.0, "swiglu", "rmsnorm", False)
    assert ModelConfig.preset("gpt2-small", dropout=0.1).dropout == 0.1


# ---- parameter counts and FLOPs: textbook numbers -----------------------------------

def test_count_params_exact():
    assert jaxformer.count_params(ModelConfig.preset("gpt2-small")) == 124_439_808
    assert jaxformer.count_params(ModelConfig.preset("llama3-8b")) == 8_030_261_248
    assert jaxformer.count_params(ModelConfig.preset("gpt2-medium")) == 354_823_168


@pytest.mark.parametrize("d", [64, 768])
def test_gpt_block_is_about_12_d_squared(d):
    """Per block: 4 (d^2 + d) attention + (4d^2 + 4d) + (4d^2 + d) MLP + 2 * 2d LayerNorm."""
    cfg = ModelConfig.preset("gpt2-small", d_model=d, n_heads=4, vocab_size=100)
    one = jaxformer.count_params(cfg.replace(n_layers=1))
    two = jaxformer.count_params(cfg.replace(n_layers=2))
    assert two - one == 12 * d * d + 13 * d
    if d == 768:
        assert two - one == 7_087_872
    assert abs((two - one) / (12 * d * d) - 1) < 0.03


def test_flops_per_token_gpt2_small():
    cfg = ModelConfig.preset("gpt2-small")
    d, L, V, T = 768, 12, 50257, 1024
    n_matmul = L * 12 * d * d + d * V  # q, k, v, o: 4d^2; MLP: 8d^2; head: dV
    assert jaxformer.flops_per_token(cfg, T) == 6 * n_matmul + 12 * L * d * (T / 2)
    # Kaplan et al.'s C ~ 6N: attention adds a few percent at T = 1024
    n = jaxformer.count_params(cfg)
    assert 1.0 < jaxformer.flops_per_token(cfg, T) / (6 * n) < 1.2


@pytest.mark.parametrize("window", [None, 100])
def test_an_encoders_queries_see_keys_on_both_sides(window):
    """An encoder's attention FLOPs count every key a query attends to, counted here."""
    T, L, d = 256, 2, 64
    cfg = ModelConfig(vocab_size=50, d_model=d, n_layers=L, n_heads=4, d_ff=4 * d,
                      max_seq_len=T, arch="encoder", sliding_window=window)
    i = np.arange(T)
    near = np.abs(i[:, None] - i[None, :]) < (window or T)
    matmul = L * 12 * d * d + d * 50  # q, k, v, o: 4d^2; MLP: 8d^2; head: dV
    keys = near.sum() / T  # the mean keys a query sees: T, or ~2w - w^2 / T
    assert jaxformer.flops_per_token(cfg, T) == pytest.approx(6 * matmul + 12 * L * d * keys,
                                                               rel=2e-3)


@pytest.mark.parametrize("tie_source_embed", [False, True])
def test_an_encoder_decoders_flops_count_both_stacks_and_the_cross_attention(tie_source_embed):
    """Per target token (the source row as long as the target row, as data.seq2seq packs
    them): 6 FLOPs for each weight of a kernel in the param tree (both stacks, the
    cross-attention, the head; the embedding tables are gathered), and 12 * n_heads *
    head_dim per query-key pair, counted on the masks: the encoder's queries see all T
    keys, the decoder's the causal half, its cross-attention all T source keys; with three
    token tables or two (tie_source_embed). The params counted without allocating are
    those an init allocates."""
    T, d, H = 128, 32, 4
    cfg = ModelConfig(vocab_size=50, d_model=d, n_layers=2, encoder_layers=3, n_heads=H,
                      n_kv_heads=2, d_ff=64, ffn="swiglu", max_seq_len=T,
                      arch="encoder_decoder", tie_embeddings=False,
                      tie_source_embed=tie_source_embed)
    leaves = jax.tree_util.tree_leaves_with_path(jaxformer.param_shapes(cfg))
    kernels = sum(np.prod(x.shape) for path, x in leaves if path[-1].key == "kernel")
    i = np.arange(T)
    causal = (i[:, None] >= i[None, :]).sum() / T
    keys = 3 * T + 2 * (causal + T)
    assert jaxformer.flops_per_token(cfg, T) == pytest.approx(6 * kernels + 12 * d * keys,
                                                              rel=1e-3)
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = jaxformer.model_for(cfg).init(jax.random.key(0), tokens)["params"]
    assert jaxformer.count_params(cfg) == sum(x.size for x in jax.tree.leaves(params))


def test_flops_per_token_gqa_and_window():
    cfg = ModelConfig.preset("llama3-8b")
    d, L, V, F, hd = 4096, 32, 128256, 14336, 128
    n_matmul = L * (d * hd * (2 * 32 + 2 * 8) + 3 * d * F) + d * V
    assert jaxformer.flops_per_token(cfg, 8192) == 6 * n_matmul + 12 * L * 32 * hd * 4096
    w, T = 1024, 8192
    windowed = jaxformer.flops_per_token(cfg.replace(sliding_window=w), T)
    assert windowed == 6 * n_matmul + 12 * L * 32 * hd * (w - w * w / (2 * T))
    assert jaxformer.flops_per_token(cfg.replace(sliding_window=T), T) == \
        jaxformer.flops_per_token(cfg, T)


def test_a_hybrids_flops_count_each_layers_own_sublayers():
    """A hybrid of gated attention, a gated delta rule, Mamba-2, a short convolution, a
    mixer-only layer and an FFN-only layer: 6 FLOPs per weight of every kernel in the
    param tree (the head tied: d x V), 12 * n_heads * head_dim per causal query-key pair
    in the attention layer alone, and 3x each recurrence's forward in its chunked form
    (jaxformer.model.mixers: a state of Dk x Dv or P x N read and written, the chunk's
    causal products, the convolution's taps)."""
    T, d = 64, 32
    kinds = {"a": {}, "g": {"mixer": "gated_delta"}, "m": {"mixer": "mamba2", "ffn": False},
             "s": {"mixer": "short_conv"}, "f": {"mixer": "none"}}
    cfg = ModelConfig(vocab_size=50, d_model=d, n_layers=5, n_heads=4, ffn="swiglu", d_ff=48,
                      norm="rmsnorm", max_seq_len=T, attn_output_gate=True,
                      layer_pattern=list(kinds), layer_kinds=kinds,
                      mixer={"gated_delta": dict(heads=2, key_dim=8, value_dim=16, chunk=16),
                             "mamba2": dict(heads=4, head_dim=8, state=4, groups=2, chunk=32),
                             "short_conv": dict(kernel=3)})
    leaves = jax.tree_util.tree_leaves_with_path(jaxformer.param_shapes(cfg))
    kernels = sum(np.prod(x.shape) for path, x in leaves
                  if path[-1].key == "kernel") + 50 * d
    delta = 2 * (6 * 8 * 16 + 2 * 16 * (8 + 16)) + 2 * 4 * (2 * 2 * 8 + 2 * 16)
    ssd = 4 * (6 * 8 * 4 + 32 * (4 + 8)) + 2 * 4 * (32 + 2 * 2 * 4)
    conv = (2 * 3 + 2) * d
    assert jaxformer.flops_per_token(cfg, T) == pytest.approx(
        6 * kernels + 12 * d * (T / 2) + 3 * (delta + ssd + conv), rel=1e-9)
