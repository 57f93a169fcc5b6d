"""The Hugging Face mixture-of-experts families (jaxformer.hf.moe_layout, and
jaxformer.hf.mla_layout for DeepSeek's latent attention; one row each in jaxformer.hf.families) against transformers itself: a random tiny model (2 layers, 4-8
experts, top-2, weights at std 0.1 so that the routing is far from uniform, windows
shorter than the input where the family has them), saved with save_pretrained, then

- read by from_hf: the float32 logits are within 1e-5 relative of transformers', unscanned
  and scanned, with every expert of every layer chosen by the batch (transformers' router)
  and the windows binding (transformers' model without them answers otherwise);
- greedy KV-cached generate: each new token is transformers' forward argmax (but at a
  near-tie);
- written back by to_hf: from_pretrained reads the same logits.

Relative error is max |ours - transformers| / max |transformers|.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, ModelConfig, Transformer, param_shapes  # noqa: E402
from jaxformer.convert import config_from_hf, config_to_hf, from_hf, to_hf  # noqa: E402
from jaxformer.decode import generate  # noqa: E402
from jaxformer.hf import MODEL_TYPES  # noqa: E402
from tests.conftest import assert_greedy_up_to_near_ties  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T, W = 96, 70, 16  # vocab, prompt length, every window (shorter than the prompt)
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {  # model_type: its config.json keys beyond COMMON
    "mixtral": dict(num_local_experts=4, sliding_window=W),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                      use_sliding_window=True, sliding_window=W),
    "olmoe": dict(num_experts=6),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                      use_sliding_window=True, sliding_window=W, max_window_layers=2),
    "granitemoe": dict(num_local_experts=4, embedding_multiplier=3.0, residual_multiplier=0.5,
                       attention_multiplier=0.1, logits_scaling=2.0),
    "gpt_oss": dict(num_local_experts=4, sliding_window=W, head_dim=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=32,
        beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # multi-head latent attention (values narrower than keys), a dense first layer, shared
    # experts; V2-Lite's full query and softmax routing by groups, V3's low-rank query and
    # sigmoid routing with the selection bias and YaRN's softmax-scale correction
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=6, moe_intermediate_size=32,
                        n_shared_experts=2, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        first_k_dense_replace=1, num_hidden_layers=3, topk_method=
                        "group_limited_greedy", n_group=2, topk_group=1,
                        routed_scaling_factor=1.5),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32,
                        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                        first_k_dense_replace=1, num_hidden_layers=3, n_group=4, topk_group=2,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=32, mscale=1.0,
                                             mscale_all_dim=1.0)),
}


def hf_config(model_type, **changes):
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type],
                                                            **changes})


def hf_model(model_type, seed=None, **changes):
    model = random_hf_model(hf_config(model_type, **changes),
                            int(rng.integers(1 << 31)) if seed is None else seed)
    with torch.no_grad():  # DeepSeek-V3's selection bias is a buffer: random too
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def router_scores(model, tokens, then=lambda logits, layer: logits):
    """transformers' logits, and each sparse layer's selection scores [tokens, experts]
    (float64): then(router logits, layer index) (the router's logits themselves by default)."""
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens)), output_router_logits=True)
        return out.logits.numpy(), [np.asarray(then(x.float(), i), np.float64).reshape(
            -1, x.shape[-1]) for i, x in enumerate(out.router_logits)]


def grouped_choice(model):
    """then(router logits, sparse layer) for router_scores: a grouped router's selection
    scores as transformers' DeepSeek routers make them (sigmoid plus the selection bias,
    groups by their top two, for V3; softmax, groups by their best, for V2's
    group_limited_greedy), the experts outside a token's topk_group groups at -1e9; a token
    whose topk_group-th and next groups are within 1e-5 gets equal scores (a margin of 0),
    so that covering_draw draws again."""
    c = model.config
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]

    def then(x, i):
        bias = getattr(gates[i], "e_score_correction_bias", None)
        s = x.sigmoid() + bias if bias is not None else x.softmax(-1)
        grouped = s.view(len(s), c.n_group, -1)
        g = grouped.topk(2, -1)[0].sum(-1) if bias is not None else grouped.max(-1)[0]
        keep = torch.zeros_like(g).scatter_(1, g.topk(c.topk_group, -1)[1], 1)
        s = s.masked_fill(keep.repeat_interleave(grouped.shape[-1], 1) == 0, -1e9)
        ranked = g.sort(-1, descending=True)[0]
        tie = ranked[:, c.topk_group - 1] - ranked[:, c.topk_group] < 1e-5
        return torch.where(tie[:, None], torch.zeros_like(s), s)
    return then


def selection_scores(model, tokens):
    """router_scores with the scores the router selects by (grouped_choice where it has
    groups: its raw logits would miss a near-tie inside the chosen groups)."""
    if (getattr(model.config, "n_group", None) or 1) > 1:
        return router_scores(model, tokens, grouped_choice(model))
    return router_scores(model, tokens)


def routed(scores, k: int) -> tuple[set, float]:
    """The experts chosen (each token's top k of scores [N, E]), and the narrowest margin
    between a token's k-th score and the next."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    ranked = np.take_along_axis(scores, order, -1)
    margin = (ranked[:, k - 1] - ranked[:, k]).min() if k < scores.shape[-1] else np.inf
    return set(order[:, :k].ravel().tolist()), float(margin)


def covering_draw(draw_model, gen, shape, experts: int, layers: int, top_k: int = 2,
                  scores=router_scores, models: int = 3, batches: int = 5):
    """(model, prompts, logits): a transformers model draw_model(seed) and a batch `shape`
    of `gen`'s tokens that reaches all `experts` of each of its `layers` sparse layers
    (each token's top_k of scores(model, tokens) -> (transformers' logits, [selection
    scores, per sparse layer])) and routes no token at a near-tie (its k-th and next
    scores within 1e-5, where float32 rounding may choose either: the logits part ways).
    A batch leaving an expert idle (a few in a hundred) is drawn again, and after
    `batches` the model: a drawn selection bias can outweigh the router's spread, so that
    no batch reaches every expert (2 of 100 ERNIE 4.5 MoE models)."""
    for _ in range(models):
        model = draw_model(int(gen.integers(1 << 31)))
        for _ in range(batches):
            prompts = gen.integers(0, model.config.vocab_size, shape)
            want, layer_scores = scores(model, prompts)
            routes = [routed(s, top_k) for s in layer_scores]
            if len(routes) == layers and all(chosen == set(range(experts)) and margin > 1e-5
                                             for chosen, margin in routes):
                return model, prompts, want
    raise AssertionError(f"no batch of {models} models reached every expert: {routes}")


def without_windows(model):
    """transformers' model with the same weights and windows longer than any input."""
    config = copy.deepcopy(model.config)
    config.sliding_window = 1 << 20
    free = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    free.load_state_dict(model.state_dict())
    return free.eval()


def assert_greedy_matches(model, cfg, params, prompts, steps=6):
    """Our greedy KV-cached tokens are transformers' forward argmax (but at a near-tie)."""
    new = np.asarray(generate(Transformer(cfg), params, prompts, max_new_tokens=steps,
                              rng=jax.random.key(0), temperature=0).tokens)
    t = prompts.shape[1]
    logits = hf_logits(model, np.concatenate([prompts, new], 1))[:, t - 1:-1]  # [B, steps, V]
    assert_greedy_up_to_near_ties(new, logits)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_moe_family_matches_transformers(model_type, tmp_path):
    config = config_from_hf(hf_config(model_type).to_dict())
    model, prompts, want = covering_draw(lambda seed: hf_model(model_type, seed), rng, (2, T),
                                         config.moe.experts, sum(config.sparse_layers),
                                         config.moe.top_k, scores=selection_scores)
    model.save_pretrained(tmp_path / "hf")
    n_experts = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    runs = len(set(config.sparse_layers))  # dense and sparse
    # the scanned model: each run of alike layers is a scan of its own
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want, model_type)
    assert len([n for n in params if n.startswith("blocks")]) == runs, sorted(params)
    assert cfg.moe.experts == n_experts and cfg.moe.top_k == 2
    if any(k.window for k in cfg.kinds):  # the windows bind: without them, another answer
        assert rel_err(hf_logits(without_windows(model), prompts), want) > 1e-3

    assert_greedy_matches(model, cfg, params, prompts)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


def test_deepseek_v3_skips_multi_token_prediction_layers(tmp_path, capsys):
    """A DeepSeek-V3 checkpoint's layers past the last (its multi-token-prediction module,
    num_nextn_predict_layers) are skipped on import with one line saying so; in another
    family a tensor of a layer past the last is an error."""
    from safetensors.numpy import load_file, save_file
    model = hf_model("deepseek_v3", first_k_dense_replace=0, num_hidden_layers=2)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("layers.1.", "layers.2.")] = tensors[name]  # an MTP layer
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg, params = from_hf(tmp_path)
    err = capsys.readouterr().err
    assert "skipping layer(s) 2" in err and "multi-token-prediction" in err
    prompts = rng.integers(0, V, (2, 8))
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
    assert rel_err(got, hf_logits(model, prompts)) < 1e-5
    other = hf_model("mixtral")
    other.save_pretrained(tmp_path / "mixtral")
    tensors = load_file(tmp_path / "mixtral" / "model.safetensors")
    tensors["model.layers.2.input_layernorm.weight"] = tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "mixtral" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor.*layers.2"):
        from_hf(tmp_path / "mixtral")


@pytest.mark.parametrize("model_type, changes", [
    ("qwen3_moe", dict(mlp_only_layers=[0])),
    ("qwen2_moe", dict(decoder_sparse_step=2, qkv_bias=False, num_hidden_layers=3)),
])
def test_dense_and_sparse_layers_as_transformers_chooses_them(model_type, changes, tmp_path):
    """mlp_only_layers and decoder_sparse_step: the dense layers are an MLP of width
    intermediate_size, the rest sparse; read, and written back, as transformers runs them."""
    model = hf_model(model_type, **changes)
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)
    cfg, params = from_hf(tmp_path / "hf")
    dense = [i for i, layer in enumerate(model.model.layers)
             if not hasattr(layer.mlp, "experts")]
    assert dense and [i for i, s in enumerate(cfg.sparse_layers) if not s] == dense
    assert rel_err(np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts)),
                   want) < 1e-5
    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_router_aux_loss_coef_is_the_same_penalty(model_type, tmp_path):
    """router_aux_loss_coef (applied with output_router_logits) times transformers'
    load_balancing_loss_func equals model.moe.aux_loss times ours (one layer, where
    transformers' pooling over layers is the layer's own)."""
    coef = float(rng.uniform(0.001, 0.1))
    model = hf_model(model_type, num_hidden_layers=1, output_router_logits=True,
                     router_aux_loss_coef=coef)
    model.save_pretrained(tmp_path)
    cfg, params = from_hf(tmp_path)
    prompts = rng.integers(0, V, (2, T))
    with torch.no_grad():
        theirs = coef * float(model(torch.tensor(prompts)).aux_loss)
    _, state = Transformer(cfg).apply({"params": params}, prompts, mutable=["moe"])
    (stats,) = jax.tree.leaves(state["moe"], is_leaf=lambda x: isinstance(x, dict) and "aux" in x)
    ours = cfg.moe.aux_loss * float(np.asarray(stats["aux"]).reshape(-1)[0])
    assert ours == pytest.approx(theirs, rel=1e-5)
    off = dict(model.config.to_dict(), output_router_logits=False)  # no penalty then
    assert config_from_hf(off).moe.aux_loss == 0


def test_export_picks_the_family_that_routes_alike(tmp_path):
    """A model of ours (softmax, top-k, renormalised: Mixtral's routing spelt as Qwen's)
    is written as Mixtral; transformers reads it to our logits."""
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                      max_seq_len=128, position="rope", norm="rmsnorm", ffn="swiglu",
                      use_bias=False, moe=dict(experts=4, top_k=2, router="softmax_topk",
                                               norm_topk=True))
    params = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(x.dtype),
                          param_shapes(cfg))
    assert to_hf(cfg, params, tmp_path)["model_type"] == "mixtral"
    prompts = rng.integers(0, V, (2, T))
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    ours = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
    assert rel_err(ours, hf_logits(back, prompts)) < 1e-5


@pytest.mark.parametrize("config, words", [
    (dict(COMMON, model_type="gpt_oss", num_local_experts=4, swiglu_limit=10.0),
     ["swiglu_limit=10.0", "gpt_oss"]),
    (dict(COMMON, model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1),
     ["router_jitter_noise=0.1", "mixtral", "jitter"]),
    (dict(COMMON, model_type="olmoe", num_experts=4, clip_qkv=8.0), ["clip_qkv=8.0", "olmoe"]),
    (dict(COMMON, model_type="qwen3_moe", num_experts=4, num_local_experts=8,
          moe_intermediate_size=32), ["num_experts", "num_local_experts", "qwen3_moe"]),
    (dict(COMMON, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32,
          shared_expert_intermediate_size=40, decoder_sparse_step=0),
     ["decoder_sparse_step=0"]),
])
def test_unsupported_moe_options_name_the_key_and_the_family(config, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(config)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_mixtures_no_family_writes_are_refused(tmp_path):
    """Experts with biases in a model without GPT-OSS's sinks and clamped SwiGLU have no
    family: one ConfigError naming model.moe; OLMoE's writer refuses heads it cannot size."""
    base = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                       position="rope", norm="rmsnorm", ffn="swiglu", use_bias=False,
                       moe=dict(experts=4, top_k=2, router="topk_softmax"))
    with pytest.raises(ConfigError, match=r"model\.moe=.* mixtral, differs in moe"):
        config_to_hf(base.replace(moe=dict(base.moe.to_dict(), bias=True)))
    with pytest.raises(ConfigError, match="head_dim=16.*OLMoE"):
        MODEL_TYPES["olmoe"].write_config(base.replace(head_dim=16, qk_norm="projection"),
                                          MODEL_TYPES["olmoe"])
