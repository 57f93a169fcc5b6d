"""config.json files that today's save_pretrained does not write (older transformers, the
Hub, hand-written) against transformers' own reading of the same file (each read by its
row, a jaxformer.hf.model_type.HFModelType).

Each case is a config.json written by hand (no layer_types; Gemma 3's legacy rope_theta /
rope_local_base_freq / rope_scaling; Gemma 3's and OLMo 3's rope_parameters flat, or keyed
by layer type beside a legacy rope_scaling; YaRN with mscale / mscale_all_dim), its sizes and
values drawn afresh. jaxformer's read_hf_config and transformers' AutoConfig read the same
folder, and per layer we compare what each derives: the sliding window (transformers: the
attention module's, or the config's for Mistral), whether the layer is rotated (Cohere2's
and SmolLM3's NoPE layers), the RoPE inverse frequencies and the attention factor
(transformers: its rotary embedding's buffers, per layer type where it has them). A few
cases also run whole: a random model built from the file, read by from_hf, gives
transformers' logits on an input longer than the window. Gemma's (1 + w) RMSNorm runs with
a large epsilon, so where epsilon sits shows in the logits.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

from jaxformer import ConfigError, ModelConfig, Transformer, param_shapes  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, read_hf_config, to_hf  # noqa: E402
from jaxformer.positions import rope_frequencies, rotary_dims  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, rel_err  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)


def theta(r):
    return float(np.round(10 ** r.uniform(3.5, 6.5)))


def yarn(r, **more):
    """A YaRN rope_scaling with DeepSeek's mscale / mscale_all_dim."""
    return dict(factor=float(r.choice([2.0, 4.0, 8.0])), original_max_position_embeddings=16,
                mscale=float(np.round(r.uniform(0.5, 1.5), 3)),
                mscale_all_dim=float(np.round(r.uniform(0.5, 1.5), 3)), **more)


# name: (model_type, r -> config.json keys beyond BASE); n: num_hidden_layers, w: a window
CASES = {
    # Qwen2 / Qwen3: layers from max_window_layers on slide, only with use_sliding_window
    "qwen2-max_window_layers": ("qwen2", lambda r, n, w: dict(
        use_sliding_window=True, sliding_window=w, max_window_layers=int(r.integers(1, n)))),
    "qwen2-use_sliding_window-false": ("qwen2", lambda r, n, w: dict(
        use_sliding_window=False, sliding_window=w, max_window_layers=int(r.integers(0, n)))),
    "qwen2-max_window_layers-0": ("qwen2", lambda r, n, w: dict(
        use_sliding_window=True, sliding_window=w, max_window_layers=0)),
    "qwen2-default-max_window_layers": ("qwen2", lambda r, n, w: dict(
        use_sliding_window=True, sliding_window=w)),
    "qwen3-max_window_layers": ("qwen3", lambda r, n, w: dict(
        head_dim=16, use_sliding_window=True, sliding_window=w,
        max_window_layers=int(r.integers(1, n)), rope_theta=theta(r))),
    # Gemma 3 / Cohere2: every sliding_window_pattern-th layer global, the rest sliding
    "gemma3-sliding_window_pattern": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=int(r.integers(2, n + 1)))),
    "gemma3-default-pattern": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, num_hidden_layers=int(r.integers(6, 9)))),
    "cohere2-sliding_window_pattern": ("cohere2", lambda r, n, w: dict(
        sliding_window=w, sliding_window_pattern=int(r.integers(2, n + 1)), rope_theta=theta(r))),
    "cohere2-default-pattern": ("cohere2", lambda r, n, w: dict(
        sliding_window=w, num_hidden_layers=int(r.integers(4, 7)))),
    "gemma2-alternating": ("gemma2", lambda r, n, w: dict(head_dim=8, sliding_window=w)),
    "olmo3-every-4th-global": ("olmo3", lambda r, n, w: dict(
        sliding_window=w, num_hidden_layers=int(r.integers(4, 7)), rope_theta=theta(r))),
    "smollm3-no_rope_layer_interval": ("smollm3", lambda r, n, w: dict(
        use_sliding_window=True, sliding_window=w, no_rope_layer_interval=int(r.integers(2, 4)))),
    "mistral-window": ("mistral", lambda r, n, w: dict(sliding_window=w)),
    "mistral-no-window": ("mistral", lambda r, n, w: dict(sliding_window=None)),
    # Gemma 3's RoPE in transformers 4.x keys: rope_theta (global layers),
    # rope_local_base_freq (sliding layers), rope_scaling (global layers only)
    "gemma3-legacy-thetas": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_theta=theta(r),
        rope_local_base_freq=theta(r))),
    "gemma3-legacy-linear": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=3, rope_theta=theta(r),
        rope_local_base_freq=theta(r),
        rope_scaling=dict(rope_type="linear", factor=float(r.uniform(2, 8))))),
    "gemma3-legacy-yarn": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_theta=theta(r),
        rope_local_base_freq=theta(r), rope_scaling=yarn(r, rope_type="yarn"))),
    "gemma3-no-rope-keys": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2)),
    # keyed rope_parameters without a theta (or without a layer type): the legacy keys fill in
    "gemma3-keyed-without-thetas": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_theta=theta(r),
        rope_local_base_freq=theta(r),
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0),
                         "sliding_attention": dict(rope_type="default")})),
    "gemma3-keyed-one-type": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_local_base_freq=theta(r),
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=theta(r))})),
    "olmo3-keyed-without-thetas": ("olmo3", lambda r, n, w: dict(
        sliding_window=w, rope_theta=theta(r),
        rope_parameters={"full_attention": dict(rope_type="default"),
                         "sliding_attention": dict(rope_type="default")})),
    # rope_parameters flat (rope_type, factor, rope_theta at its top): transformers 5 builds
    # Gemma 3's and OLMo 3's rotary embeddings from the per-type entries alone, which its
    # config classes fill from the legacy keys and defaults, so the flat keys go unread
    "gemma3-flat": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2,
        rope_parameters=yarn(r, rope_type="yarn", rope_theta=theta(r)),
        **({"rope_theta": theta(r), "rope_local_base_freq": theta(r)} if r.random() < 0.5
           else {}))),
    "olmo3-flat": ("olmo3", lambda r, n, w: dict(
        sliding_window=w, rope_theta=theta(r),
        rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=theta(r)))),
    # flat keys beside the entries (what transformers' to_dict writes after reading a flat one)
    "gemma3-flat-beside-keyed": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_parameters={
            "rope_type": "linear", "factor": 8.0, "rope_theta": theta(r),
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=theta(r)),
            "sliding_attention": None})),
    # keyed rope_parameters beside a legacy rope_scaling: it updates the full-attention entry
    "gemma3-keyed-beside-rope_scaling": ("gemma3_text", lambda r, n, w: dict(
        head_dim=8, sliding_window=w, sliding_window_pattern=2, rope_local_base_freq=theta(r),
        rope_scaling=yarn(r, rope_type="yarn"), rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=theta(r)),
            "sliding_attention": dict(rope_type="linear", factor=3.0)})),
    "olmo3-keyed-beside-rope_scaling": ("olmo3", lambda r, n, w: dict(
        sliding_window=w, rope_theta=theta(r),
        rope_scaling=dict(rope_type="linear", factor=float(r.uniform(2, 8))),
        rope_parameters={"full_attention": dict(rope_type="default"),
                         "sliding_attention": dict(rope_type="default", rope_theta=theta(r))})),
    # YaRN with mscale / mscale_all_dim: the attention factor is their ratio of
    # 0.1 mscale ln(factor) + 1 (both needed; an attention_factor wins over them)
    "llama-yarn-4.x": ("llama", lambda r, n, w: dict(
        rope_theta=theta(r), rope_scaling=yarn(r, type="yarn"))),
    "llama-yarn-5-betas": ("llama", lambda r, n, w: dict(rope_parameters=yarn(
        r, rope_type="yarn", rope_theta=theta(r), beta_fast=float(r.integers(8, 48)),
        beta_slow=float(r.uniform(0.5, 2))))),
    "qwen2-yarn-mscale-alone": ("qwen2", lambda r, n, w: dict(rope_scaling={
        k: v for k, v in yarn(r, type="yarn").items() if k != "mscale_all_dim"})),
    "qwen3-yarn-attention_factor-wins": ("qwen3", lambda r, n, w: dict(
        head_dim=8, rope_parameters=yarn(r, rope_type="yarn", rope_theta=theta(r),
                                         attention_factor=float(r.uniform(0.5, 2))))),
    "gpt_neox-yarn-partial": ("gpt_neox", lambda r, n, w: dict(
        num_key_value_heads=None, rotary_pct=0.5, rope_scaling=yarn(r, rope_type="yarn"))),
}


def hand_written(name) -> dict:
    """CASES[name] as a config.json holds it, its values drawn from rng."""
    model_type, keys = CASES[name]
    n, w = int(rng.integers(3, 6)), int(rng.integers(2, 6))
    d = {**BASE, "model_type": model_type, "num_hidden_layers": n, **keys(rng, n, w)}
    return {k: v for k, v in d.items() if v is not None or k != "num_key_value_heads"}


def write(folder, d):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d, indent=2))
    return folder


def hf_layers(folder) -> list[tuple]:
    """Per layer, as transformers builds the model of the folder's config.json:
    (window, rotated, inverse frequencies, attention factor)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config)
    rotary = model.base_model.rotary_emb
    types = getattr(config, "layer_types", None)
    out = []
    for i, layer in enumerate(model.base_model.layers):
        attn = getattr(layer, "self_attn", None)
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        rotated = (window is not None if config.model_type == "cohere2"
                   else bool(getattr(attn, "use_rope", True)))
        prefix = f"{types[i]}_" if types and hasattr(rotary, f"{types[i]}_inv_freq") else ""
        out.append((window, rotated, getattr(rotary, f"{prefix}inv_freq").numpy(),
                    float(getattr(rotary, f"{prefix}attention_scaling"))))
    return out


def our_layers(cfg: ModelConfig) -> list[tuple]:
    """The same per layer from jaxformer's config (frequencies in float64)."""
    rot = rotary_dims(cfg.head_dim, cfg.rope_fraction)
    out = []
    for i in cfg.layer_kind_ids:
        k = cfg.kinds[i]
        inv_freq, factor = rope_frequencies(rot, k.rope_theta, k.rope_scaling)
        out.append((k.window, cfg.position == "rope" and k.rope, inv_freq, factor))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_hand_written_config_reads_as_transformers_reads_it(name, tmp_path):
    """Per layer, jaxformer's window, rotation, RoPE inverse frequencies and attention
    factor of a hand-written config.json are those transformers builds from it."""
    d = hand_written(name)
    folder = write(tmp_path, d)
    theirs, ours = hf_layers(folder), our_layers(read_hf_config(folder))
    assert len(ours) == len(theirs) == d["num_hidden_layers"]
    # (window, rotated) of each layer
    assert [t[:2] for t in ours] == [t[:2] for t in theirs], d
    for i, (o, t) in enumerate(zip(ours, theirs)):
        if t[1]:
            np.testing.assert_allclose(o[2], t[2], rtol=2e-6, err_msg=f"layer {i} inv_freq {d}")
            assert o[3] == pytest.approx(t[3], rel=1e-9), (i, "attention factor", o[3], t[3], d)


def hf_model(d, folder):
    """A random transformers model of the hand-written config.json `d` (weights std 0.1,
    norm weights perturbed), saved in `folder` beside `d` itself as its config.json."""
    config = transformers.AutoConfig.from_pretrained(write(folder, d))
    model = random_hf_model(config, int(rng.integers(1 << 31)))
    model.save_pretrained(folder)
    write(folder, d)  # the hand-written file, not the one save_pretrained wrote
    return model


@pytest.mark.parametrize("name", ["qwen2-max_window_layers", "gemma3-legacy-linear",
                                  "gemma3-keyed-beside-rope_scaling"])
def test_hand_written_config_logits_match_transformers(name, tmp_path):
    """A model of a hand-written config.json (windows shorter than the 12 tokens) gives
    transformers' logits within 1e-5 relative."""
    d = hand_written(name)
    model = hf_model(d, tmp_path)
    tokens = rng.integers(0, 64, (2, 12))
    cfg, params = from_hf(tmp_path)
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))
    err = rel_err(got, hf_logits(model, tokens))
    assert err < 1e-5, (err, d)


def test_gemma_norm_epsilon_placement_shows_in_the_logits(tmp_path):
    """Gemma 3 (RMSNorm x / sqrt(mean x^2 + eps) * (1 + w) before and after each block, and
    on q and k) with rms_norm_eps 0.5, comparable to mean x^2: transformers' logits within
    1e-5 relative. With its eps at 1e-6, transformers' own logits move far beyond that."""
    eps = float(rng.uniform(0.3, 1.0))
    d = dict(BASE, model_type="gemma3_text", num_hidden_layers=2, head_dim=8, sliding_window=4,
             sliding_window_pattern=2, rms_norm_eps=eps)
    model = hf_model(d, tmp_path)
    tokens = rng.integers(0, 64, (2, 12))
    want = hf_logits(model, tokens)
    cfg, params = from_hf(tmp_path)
    assert cfg.norm == "rmsnorm_offset" and cfg.norm_eps == eps
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))
    err = rel_err(got, want)
    assert err < 1e-5, (err, eps)
    small = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path, rms_norm_eps=1e-6),
        attn_implementation="eager").eval()
    small.load_state_dict(model.state_dict())
    assert rel_err(hf_logits(small, tokens), want) > 1e-2  # eps matters here


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo3"])
def test_rope_scaling_beside_a_rope_parameters_without_a_full_attention_entry(model_type,
                                                                              tmp_path):
    """A legacy rope_scaling updates rope_parameters' full_attention entry; beside a
    rope_parameters without one (flat, or keyed for sliding layers alone) transformers'
    config class cannot load the file, and jaxformer refuses it in one line."""
    scaling = dict(rope_type="linear", factor=float(rng.uniform(2, 8)))
    for params in (dict(rope_type="linear", factor=2.0, rope_theta=theta(rng)),
                   {"sliding_attention": dict(rope_type="default", rope_theta=theta(rng))}):
        d = dict(BASE, model_type=model_type, num_hidden_layers=2, head_dim=8, sliding_window=4,
                 rope_scaling=scaling, rope_parameters=params)
        with pytest.raises(KeyError, match="full_attention"):
            transformers.AutoConfig.from_pretrained(write(tmp_path / "hf", d))
        with pytest.raises(ConfigError, match="rope_scaling=.* without a full_attention") as e:
            config_from_hf(d)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16),
    dict(rope_type="llama3", factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=16)])
def test_phi3_takes_only_the_rope_transformers_takes(rope, tmp_path):
    """transformers' Phi3Config refuses any RoPE scaling but longrope (it reads yarn as
    longrope); jaxformer refuses to read such a file, and to write a Phi-3-only model (a
    partial rotary fraction) with that scaling."""
    d = dict(BASE, model_type="phi3", num_hidden_layers=2,
             rope_parameters=dict(rope, rope_theta=1e4, partial_rotary_factor=0.5))
    with pytest.raises(Exception, match="longrope"):  # a KeyError or a validation error
        transformers.AutoConfig.from_pretrained(write(tmp_path / "hf", d))
    with pytest.raises(ConfigError, match="phi3"):
        config_from_hf(d)
    kind = {"rope_type": "kind", "original_max_position_embeddings": "original_max_seq_len"}
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, norm="rmsnorm",
                      ffn="swiglu", use_bias=False, rope_fraction=0.5,
                      rope_scaling={kind.get(k, k): v for k, v in rope.items()})
    with pytest.raises(ConfigError, match="cannot be written"):
        to_hf(cfg, param_shapes(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()
