"""Hugging Face interop (jaxformer.convert: its CLI, jaxformer.convert.hf and the config
mapping jaxformer.convert.hf_config) against transformers itself.

Every model is built from a config with fresh random weights (norm weights and biases
perturbed too, so a swapped or dropped one shows), saved with save_pretrained, converted,
and compared: logits on 512 tokens (short prompts hide RoPE bugs), greedy decoding, round
trips, sharded loading, the CLI, and the errors for bad inputs. Relative error is
max |ours - transformers| / max |transformers| over all logits, in float32.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxformer import ConfigError, ModelConfig, Transformer, param_shapes  # noqa: E402
from jaxformer.convert import (from_hf, permute_half_to_interleaved,  # noqa: E402
                               permute_interleaved_to_half, read_hf_config, to_hf)
from jaxformer.decode import generate  # noqa: E402
from jaxformer.decode.constraints import Constraints  # noqa: E402
from tests.conftest import REPO, xla_flags  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
T = transformers
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, bos_token_id=None, eos_token_id=None)
GPT2 = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=None,
            eos_token_id=None)
HF_CASES = {  # name: (model class, config): GQA/MQA, every RoPE scaling HF and we share
    "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(**GPT2, n_positions=512)),
    "llama-gqa-llama3": (T.LlamaForCausalLM, T.LlamaConfig(
        **SMALL, num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-mqa-bias-tied-yarn": (T.LlamaForCausalLM, T.LlamaConfig(
        **SMALL, num_key_value_heads=1, max_position_embeddings=512, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True, head_dim=32,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128))),
    "llama-linear": (T.LlamaForCausalLM, T.LlamaConfig(
        **SMALL, num_key_value_heads=2, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral-window": (T.MistralForCausalLM, T.MistralConfig(
        **SMALL, num_key_value_heads=2, sliding_window=64)),
    "qwen2-qkv-bias": (T.Qwen2ForCausalLM, T.Qwen2Config(**SMALL, num_key_value_heads=2)),
    # GPT-NeoX with sequential residuals and full rotary; "gelu" is the exact (erf) GELU,
    # gelu_new the tanh one. Weights at std 0.1: attention far from uniform, so a q/k mixup
    # shows
    "neox-gelu-untied": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
        **SMALL, use_parallel_residual=False, rotary_pct=1.0, max_position_embeddings=512,
        initializer_range=0.1)),
    "neox-gelu_new-tied": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
        **SMALL, use_parallel_residual=False, rotary_pct=1.0, max_position_embeddings=512,
        hidden_act="gelu_new", tie_word_embeddings=True, initializer_range=0.1,
        rotary_emb_base=5000.0)),
}


def hf_model(name, **changes):
    """A fresh random transformers model of HF_CASES[name]; 1-D params (norms, biases)
    perturbed away from their 1 / 0 init."""
    cls, config = HF_CASES[name]
    config = type(config).from_dict({**config.to_dict(), **changes})
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.5 * torch.randn_like(p))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def our_logits(cfg, params, tokens):
    return np.asarray(jitted_apply(cfg)({"params": params}, tokens))


@functools.lru_cache
def jitted_apply(cfg):
    return jax.jit(Transformer(cfg).apply)


def rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def tree_equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def tensors(folder):
    out = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# ---- logits and decoding against transformers ---------------------------------------


@pytest.mark.parametrize("name", list(HF_CASES))
def test_logits_match_transformers_on_512_tokens(name, tmp_path):
    model = hf_model(name)
    model.save_pretrained(tmp_path)
    cfg, params = from_hf(tmp_path)
    tokens = rng.integers(0, 256, (1, 512))
    ref = hf_logits(model, tokens)
    err = rel_err(our_logits(cfg, params, tokens), ref)
    print(f"{name}: max relative logit error {err:.2e}")
    assert err < 1e-4
    if name == "mistral-window":  # the window (64 < 512) is really in play
        assert cfg.sliding_window == 64
        assert rel_err(our_logits(cfg.replace(sliding_window=None), params, tokens), ref) > 1e-2
    if name.startswith("neox"):  # the other GELU is far off (their gap alone is ~1e-4)
        other = {"gelu": "gelu_exact", "gelu_exact": "gelu"}[cfg.ffn]
        assert rel_err(our_logits(cfg.replace(ffn=other), params, tokens), ref) > 10 * err


@pytest.mark.parametrize("name, constrained", [("gpt2", False), ("llama-gqa-llama3", False),
                                               ("gpt2", True)])
def test_greedy_decoding_matches_hf_generate(name, constrained, tmp_path):
    """Greedy tokens as transformers' generate's; constrained: with no bigram repeated
    (the prompt's included) and no EOS before the 8th new token (EOS: the token the model
    as drawn ranks highest after the prompt, so that the ban bites)."""
    # init std 0.3: peaked, varied next-token distributions rather than a near-uniform
    # one that repeats a token; a draw whose greedy tokens still hold under 4 distinct
    # ids (3 in 64, as a run drew once) is drawn again
    for attempt in range(5):
        model = hf_model(name, initializer_range=0.3)
        model.save_pretrained(tmp_path / str(attempt))
        cfg, params = from_hf(tmp_path / str(attempt))
        prompts = rng.integers(0, 256, (2, 16))
        kw, theirs_kw = {}, {}
        if constrained:
            eos = int(np.argmax(our_logits(cfg, params, prompts)[0, -1]))
            kw = dict(eos_id=eos, pad_id=eos, constraints=Constraints(min_new_tokens=8,
                                                                      no_repeat_ngram_size=2))
            theirs_kw = dict(eos_token_id=eos, min_new_tokens=8, no_repeat_ngram_size=2)
        ours = np.asarray(generate(Transformer(cfg), params, prompts, max_new_tokens=32,
                                   rng=jax.random.key(0), temperature=0, **kw).tokens)
        if len(set(ours.ravel().tolist())) >= 4:  # not one repeated token
            break
    else:
        pytest.fail(f"5 draws' greedy tokens held under 4 distinct ids: {ours}")
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompts), attention_mask=torch.ones(2, 16, dtype=int),
                                do_sample=False, max_new_tokens=32,
                                pad_token_id=kw.get("pad_id", 0), **theirs_kw)
    theirs = np.pad(theirs.numpy()[:, 16:], ((0, 0), (0, 16 + 32 - theirs.shape[1])),
                    constant_values=kw.get("pad_id", 0))
    # the top-2 logit gap at each step: a difference is allowed only at a near-tie, where
    # float32 rounding may legitimately pick the other token (then the rest is moot)
    logits = our_logits(cfg, params, np.concatenate([prompts, ours], 1))[:, 15:-1]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]  # [2, 32]
    for row in range(2):
        diff = np.flatnonzero(ours[row] != theirs[row])
        if diff.size:
            assert gap[row, diff[0]] < 1e-4, (row, diff[0], ours[row], theirs[row])


# ---- round trips ------------------------------------------------------------------


OUR_CASES = {
    "gpt2-untied": dict(position="learned", tie_embeddings=False, max_seq_len=128),
    "llama-gqa-scan-llama3": dict(
        n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False, tie_embeddings=False,
        scan_layers=True, rope_theta=500000.0,
        rope_scaling=dict(kind="llama3", factor=8.0, original_max_seq_len=32)),
    "qwen2-geglu-window": dict(n_kv_heads=2, norm="rmsnorm", ffn="geglu", use_bias=False,
                               qkv_bias=True, sliding_window=16),
    "llama-bias-yarn": dict(n_kv_heads=1, norm="rmsnorm", ffn="swiglu", use_bias=True,
                            head_dim=32, rope_scaling=dict(kind="yarn", factor=2.0,
                                                           original_max_seq_len=64)),
    "mistral-window": dict(n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False,
                           sliding_window=32, max_seq_len=128),
    # the shape `make train` produces (configs/tiny.yaml: RoPE, pre-LN LayerNorm, tanh
    # GELU, biases, tied), and the exact GELU untied, scanned, with scaled RoPE
    "gpt_neox-tiny-shape": dict(),
    "gpt_neox-exact-untied-scan-llama3": dict(
        ffn="gelu_exact", tie_embeddings=False, scan_layers=True, rope_theta=5000.0,
        rope_scaling=dict(kind="llama3", factor=8.0, original_max_seq_len=32)),
}


def our_model(name):
    cfg = ModelConfig(**{**dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                max_seq_len=256), **OUR_CASES[name]})
    return cfg, init_params(cfg)


def init_params(cfg, std=0.2):
    """Fresh random params (no init to compile): norm scales 1 + N(0, std), every other
    leaf (biases included) N(0, std)."""
    def draw(path, x):
        base = 1.0 if path[-1].key == "scale" else 0.0
        return (base + rng.normal(0, std, x.shape)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))


@pytest.mark.parametrize("name", list(OUR_CASES))
def test_round_trip_ours_hf_ours(name, tmp_path):
    cfg, params = our_model(name)
    shard = 60_000 if name == "gpt2-untied" else None  # also an index and several shards
    hf = to_hf(cfg, params, tmp_path, max_shard_bytes=shard)
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    assert hf["model_type"] == name.split("-")[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = rng.integers(0, 256, (2, 128))
    err = rel_err(our_logits(cfg, params, tokens), hf_logits(model, tokens))
    assert err < 1e-4, err
    cfg2, params2 = from_hf(tmp_path, scan_layers=cfg.scan_layers)
    assert cfg2 == cfg
    assert tree_equal(params2, params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_hf_ours_hf_keeps_every_tensor(tmp_path, dtype):
    model = hf_model("qwen2-qkv-bias").to(getattr(torch, dtype))
    model.save_pretrained(tmp_path / "a")
    cfg, params = from_hf(tmp_path / "a", scan_layers=True, dtype=dtype)
    assert cfg.param_dtype == dtype and {x.dtype.name for x in jax.tree.leaves(params)} == {dtype}
    to_hf(cfg, params, tmp_path / "b", dtype=dtype)
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype == dtype for k in a)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    if dtype == "bfloat16":  # read as float32 by default: the exact upcast
        _, upcast = from_hf(tmp_path / "a", scan_layers=True)
        assert tree_equal(upcast, jax.tree.map(lambda x: x.astype(np.float32), params))


def test_interleaved_rope_layout(tmp_path):
    x = rng.normal(size=(3, 5, 8))
    assert np.array_equal(permute_half_to_interleaved(permute_interleaved_to_half(x)), x)
    assert np.array_equal(permute_interleaved_to_half(permute_half_to_interleaved(x)), x)
    model = hf_model("llama-gqa-llama3")
    model.save_pretrained(tmp_path / "half")
    c = model.config
    # Meta's interleaved layout: the inverse of transformers' convert_llama_weights_to_hf
    # permute, w.view(heads, dim // heads // 2, 2, in).transpose(1, 2)
    inter = {}
    for name, w in tensors(tmp_path / "half").items():
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(
            name.split(".")[-2])
        if heads:
            w = torch.tensor(w).view(heads, 2, c.head_dim // 2, -1).transpose(1, 2)
            w = w.reshape(heads * c.head_dim, -1).numpy()
        inter[name] = np.ascontiguousarray(w)
    (tmp_path / "inter").mkdir()
    save_file(inter, str(tmp_path / "inter" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "inter" / "config.json").write_text((tmp_path / "half" / "config.json").read_text())

    cfg, params = from_hf(tmp_path / "half")
    cfg_i, params_i = from_hf(tmp_path / "inter", rope_layout="interleaved")
    assert cfg_i == cfg and tree_equal(params_i, params)
    _, wrong = from_hf(tmp_path / "inter")  # read as half: other q/k kernels
    assert not np.array_equal(wrong["block_0"]["attn"]["query"]["kernel"],
                              params["block_0"]["attn"]["query"]["kernel"])
    to_hf(cfg, params, tmp_path / "back", rope_layout="interleaved")
    back = tensors(tmp_path / "back")
    assert sorted(back) == sorted(inter) and all(np.array_equal(back[k], inter[k]) for k in inter)
    tokens = rng.integers(0, 256, (1, 512))
    assert np.array_equal(our_logits(cfg_i, params_i, tokens), our_logits(cfg, params, tokens))


def test_old_gpt2_layout_without_prefix_and_with_mask_buffers(tmp_path):
    cfg, params = our_model("gpt2-untied")
    to_hf(cfg, params, tmp_path)
    old = {k.removeprefix("transformer."): v for k, v in tensors(tmp_path).items()}
    mask = np.tril(np.ones((1, 1, 128, 128), np.float32))
    old.update({f"h.{i}.attn.bias": mask for i in range(cfg.n_layers)})
    save_file(old, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg2, params2 = from_hf(tmp_path)
    assert cfg2 == cfg and tree_equal(params2, params)


def test_pythia_layout_without_prefix_and_with_buffers(tmp_path):
    """Pythia's checkpoints (transformers 4.x) also hold causal-mask and RoPE buffers; a
    GPTNeoXModel's lack the gpt_neox. prefix."""
    cfg, params = our_model("gpt_neox-tiny-shape")
    to_hf(cfg, params, tmp_path)
    old = {k.removeprefix("gpt_neox."): v for k, v in tensors(tmp_path).items()}
    for i in range(cfg.n_layers):
        old.update({f"layers.{i}.attention.bias": np.tril(np.ones((1, 1, 8, 8), bool)),
                    f"layers.{i}.attention.masked_bias": np.array(-1e9, np.float32),
                    f"layers.{i}.attention.rotary_emb.inv_freq": np.ones(8, np.float32)})
    save_file(old, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg2, params2 = from_hf(tmp_path)
    assert cfg2 == cfg and tree_equal(params2, params)


# ---- sharded loading ----------------------------------------------------------------


SHARDED = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jaxformer import ModelConfig, Transformer
    from jaxformer.convert import from_hf, to_hf
    from jaxformer.core.sharding import make_mesh, param_shardings, resolve_rules

    assert jax.device_count() == 8, jax.devices()
    path = sys.argv[1]
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                      norm="rmsnorm", ffn="swiglu", use_bias=False, tie_embeddings=False)
    params = Transformer(cfg).init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    to_hf(cfg, params, path)
    mesh = make_mesh(1, 2, 4)  # the library's rules: embed over fsdp, heads/mlp/vocab over tensor

    def rules_for(c):
        return param_shardings(Transformer(c), mesh, resolve_rules())

    for scan in (False, True):
        _, plain = from_hf(path, scan_layers=scan)
        cfg2, sharded = from_hf(path, scan_layers=scan, shardings=rules_for)
        assert cfg2.scan_layers == scan
        wanted = jax.tree.leaves(rules_for(cfg2))
        for (path_, x), y, want in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                       jax.tree.leaves(plain), wanted):
            assert x.sharding == want, (path_, x.sharding, want)
            shard_shape = want.shard_shape(y.shape)
            assert len(x.addressable_shards) == 8
            assert all(s.data.shape == shard_shape for s in x.addressable_shards), path_
            assert np.array_equal(np.asarray(x), np.asarray(y)), path_
        emb = sharded["embed"]["embedding"]
        assert emb.addressable_shards[0].data.shape == (64, 32)  # [256, 64]: vocab/4, embed/2
        head = sharded["lm_head"]["kernel"]
        assert head.addressable_shards[0].data.shape == (32, 64)  # [64, 256]: embed/2, vocab/4
    print("OK")
""")


def test_sharded_loading_puts_only_its_slice_on_each_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices=8),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "hf")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


# ---- the CLI: HF -> training run -> HF -------------------------------------------------


def test_cli_from_hf_makes_a_run_and_to_hf_exports_it(tmp_path, capsys):
    from jaxformer.convert.__main__ import main
    from jaxformer.training.saved_run import load_run

    model = hf_model("llama-gqa-llama3")
    model.save_pretrained(tmp_path / "hf")
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["from-hf", str(tmp_path / "hf"), str(run), "train.steps=5"]) == 0
    printed = capsys.readouterr().out
    assert "model_type llama" in printed and "n_kv_heads: 2" in printed and "llama3" in printed
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "0").is_dir()
    cfg, params = from_hf(tmp_path / "hf")
    jmodel, run_params, _ = load_run(str(run))  # what generate.py / train.py read
    assert jmodel.cfg == cfg and tree_equal(run_params, params)
    assert main(["from-hf", str(tmp_path / "hf"), str(run)]) == 2  # not over a run
    assert main(["to-hf", str(run / "checkpoints" / "0"), str(out)]) == 0
    assert '"model_type": "llama"' in capsys.readouterr().out
    a, b = tensors(tmp_path / "hf"), tensors(out)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "r2"), "model.d_model=32"]) == 2
    assert "model.d_model" in capsys.readouterr().err
    # --model-type: a model type that cannot say this model is one line, exit 2
    assert main(["to-hf", str(run), str(tmp_path / "o2"), "--model-type", "qwen3"]) == 2
    assert "qwen3" in capsys.readouterr().err and not (tmp_path / "o2" / "config.json").exists()


def test_cli_to_hf_exports_the_tiny_preset_as_gpt_neox(tmp_path, capsys):
    """A run of configs/tiny.yaml's model (what `make train` makes) goes out as GPT-NeoX:
    a run made from it by from-hf, to-hf again, the same tensors and transformers' logits."""
    from jaxformer.convert.__main__ import main

    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, std=0.1)
    assert to_hf(cfg, params, tmp_path / "hf")["model_type"] == "gpt_neox"
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["from-hf", str(tmp_path / "hf"), str(run), "train.steps=5"]) == 0
    assert "gpt_neox" in capsys.readouterr().out
    assert main(["to-hf", str(run), str(out)]) == 0
    assert '"model_type": "gpt_neox"' in capsys.readouterr().out
    a, b = tensors(tmp_path / "hf"), tensors(out)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = rng.integers(0, 256, (1, 256))
    assert rel_err(our_logits(cfg, params, tokens), hf_logits(model, tokens)) < 1e-4


def test_gpt_neox_interleaved_rope_layout(tmp_path):
    cfg, params = our_model("gpt_neox-tiny-shape")
    to_hf(cfg, params, tmp_path / "half")
    to_hf(cfg, params, tmp_path / "inter", rope_layout="interleaved")
    half, inter = tensors(tmp_path / "half"), tensors(tmp_path / "inter")
    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    w = half[name].reshape(4, 3, 16, 64)  # [heads, q|k|v, head_dim, in]
    want = np.concatenate([permute_half_to_interleaved(w[:, :2].swapaxes(-1, -2)).swapaxes(
        -1, -2), w[:, 2:]], axis=1).reshape(192, 64)  # q and k permuted, v as is
    assert np.array_equal(inter[name], want)
    cfg2, params2 = from_hf(tmp_path / "inter", rope_layout="interleaved")
    assert cfg2 == cfg and tree_equal(params2, params)


# ---- errors -------------------------------------------------------------------------


@pytest.fixture
def gpt2_dir(tmp_path):
    cfg, params = our_model("gpt2-untied")
    to_hf(cfg, params, tmp_path / "gpt2")
    return tmp_path / "gpt2"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_tensors(folder, fn):
    t = tensors(folder)
    fn(t)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_files_are_named(tmp_path, gpt2_dir):
    with pytest.raises(FileNotFoundError, match="nowhere.*is not a folder"):
        from_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        from_hf(tmp_path / "empty")
    (gpt2_dir / "model.safetensors").rename(gpt2_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*pytorch_model.bin.*pickle"):
        from_hf(gpt2_dir)
    (gpt2_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard.*model-00001-of-00002"):
        from_hf(gpt2_dir)


def test_bad_tensors_are_named(gpt2_dir):
    name = "transformer.h.1.mlp.c_fc.weight"
    edit_tensors(gpt2_dir, lambda t: t.update({name: t[name][:, :100]}))
    with pytest.raises(ValueError, match=rf"{name} .* shape \[64, 100\].*implies \[64, 256\]"):
        from_hf(gpt2_dir)
    edit_tensors(gpt2_dir, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"1 tensor\(s\) .* missing .*{name}"):
        from_hf(gpt2_dir)
    edit_tensors(gpt2_dir, lambda t: t.update({name: np.zeros((64, 256), np.float32),
                                               "transformer.h.0.extra.weight": np.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\).*h\.0\.extra\.weight"):
        from_hf(gpt2_dir)


def test_tied_head_must_equal_the_embedding(gpt2_dir):
    edit_config(gpt2_dir, tie_word_embeddings=True)
    edit_tensors(gpt2_dir, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"]}))
    cfg, params = from_hf(gpt2_dir)  # a redundant copy of the embedding is fine
    assert cfg.tie_embeddings and "lm_head" not in params
    edit_tensors(gpt2_dir, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(ValueError, match="lm_head.weight .*differs"):
        from_hf(gpt2_dir)


DROP = object()


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="xlnet", architectures=["XLNetLMHeadModel"]),
     "unsupported model_type 'xlnet'.*gpt2, llama, mistral, qwen2"),
    (dict(architectures=["GPT2ForSequenceClassification"]),
     "GPT2ForSequenceClassification.*GPT2LMHeadModel"),
    (dict(activation_function="gelu"), "activation_function='gelu'.*tanh"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(n_embd=DROP), "no 'n_embd'"),
])
def test_unsupported_gpt2_configs_are_named(gpt2_dir, changes, match):
    config = {**json.loads((gpt2_dir / "config.json").read_text()), **changes}
    config = {k: v for k, v in config.items() if v is not DROP}
    (gpt2_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        read_hf_config(gpt2_dir)
    with pytest.raises(ConfigError, match=match):
        from_hf(gpt2_dir)


LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256,
             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     "rope_type='dynamic'.*default, linear, llama3, yarn"),
    (dict(rope_scaling=dict(type="linear", factor=2.0, mscale=1.0)), "unknown key.*mscale"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(attention_bias=True, mlp_bias=False), "attention_bias=True with mlp_bias=False"),
    (dict(hidden_act="relu"), "hidden_act='relu'"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
          sliding_window=16, layer_types=["chunked_attention", "full_attention"]),
     "layer_types.*chunked_attention"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
          layer_types=["sliding_attention", "full_attention"]), "layer_types.*no sliding_window"),
])
def test_unsupported_llama_configs_are_named(changes, match):
    from jaxformer.convert import config_from_hf
    with pytest.raises(ConfigError, match=match):
        config_from_hf({**LLAMA, **changes})


NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=256,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            use_parallel_residual=False, rotary_pct=1.0)
NEOX_V5 = {**{k: v for k, v in NEOX.items() if k != "rotary_pct"},
           "rope_parameters": dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=1.0)}


@pytest.mark.parametrize("config, match", [
    (dict(NEOX, rotary_pct=1.5), "rotary_pct=1.5.*in \\(0, 1\\]"),
    (dict(NEOX_V5, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                        partial_rotary_factor=0.0)),
     r"rope_parameters\.partial_rotary_factor=0.0"),
    (dict(NEOX, hidden_act="gelu_fast"), "hidden_act='gelu_fast'.*gpt_neox"),
    (dict(NEOX, attention_bias=False), "attention_bias=False.*gpt_neox"),
    (dict(NEOX, architectures=["GPTNeoXForSequenceClassification"]),
     "GPTNeoXForSequenceClassification.*GPTNeoXForCausalLM"),
])
def test_unsupported_gpt_neox_configs_are_named(config, match):
    from jaxformer.convert import config_from_hf
    with pytest.raises(ConfigError, match=match):
        config_from_hf(config)


def test_gpt_neox_configs_of_both_transformers_generations():
    from jaxformer.convert import config_from_hf
    v4 = config_from_hf({**NEOX, "rotary_emb_base": 5e5, "hidden_act": "gelu",
                         "rope_scaling": None})
    v5 = config_from_hf({**NEOX_V5, "rope_parameters": dict(
        rope_type="default", rope_theta=5e5, partial_rotary_factor=1.0)})
    assert v4 == v5 and v5.rope_theta == 5e5 and v5.ffn == "gelu_exact"
    assert v5.norm == "layernorm" and v5.use_bias and v5.qkv_bias and not v5.tie_embeddings
    assert config_from_hf(dict(NEOX, hidden_act="gelu_new")).ffn == "gelu"


def test_llama_configs_of_both_transformers_generations():
    from jaxformer.convert import config_from_hf
    v4 = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": dict(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)})
    v5 = config_from_hf({**LLAMA, "rope_parameters": dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64)})
    assert v4 == v5 and v5.rope_theta == 5e5 and v5.rope_scaling.kind == "llama3"
    assert v5.rope_scaling.original_max_seq_len == 64 and v5.n_kv_heads == 4


@pytest.mark.parametrize("changes, match", [
    (dict(position="alibi"), "model.position='alibi'"),
    (dict(position="sinusoidal"), "model.position='sinusoidal'"),
    (dict(position="t5"), "model.position='t5'"),
    (dict(position="fire"), "model.position='fire'"),
    (dict(block="post_ln"), "model.block='post_ln'"),
    (dict(norm="rmsnorm", ffn="relu", use_bias=False), "model.ffn='relu'"),
    (dict(norm="layernorm", ffn="swiglu", use_bias=False), "model.norm='layernorm'"),
    (dict(norm="rmsnorm", ffn="swiglu", rope_scaling="ntk"), "model.rope_scaling.kind='ntk'"),
    # biases on o and the MLP but not q/k/v are Seed-OSS's, which has no window
    (dict(norm="rmsnorm", ffn="swiglu", use_bias=True, qkv_bias=False, sliding_window=8),
     "model.use_bias=True"),
    (dict(position="learned", n_kv_heads=2), "model.n_kv_heads=2"),
    (dict(n_kv_heads=2), "model.n_kv_heads=2 .*nearest, gpt_neox, differs in n_kv_heads"),
    (dict(use_bias=False), "model.use_bias=False .*gpt_neox, differs in use_bias"),
    (dict(sliding_window=8), "model.sliding_window=8 .*gpt_neox, differs in sliding_window"),
    (dict(block="parallel", n_kv_heads=2), "model.n_kv_heads=2 .*gpt_neox"),
    # LFM2's convolution layers have an FFN: one without is no family's
    (dict(norm="rmsnorm", ffn="swiglu", use_bias=False, position="none", layer_pattern=["c"],
          layer_kinds={"c": {"mixer": "short_conv", "ffn": False}}), "model.layer_kinds"),
])
def test_models_hf_cannot_express_are_refused(tmp_path, changes, match):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, **changes)
    params = param_shapes(cfg)  # refused before any weight is read
    with pytest.raises(ConfigError, match=match):
        to_hf(cfg, params, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_params_that_do_not_match_the_config_are_refused(tmp_path):
    cfg, params = our_model("gpt2-untied")
    with pytest.raises(ValueError, match="param block_0/ffn/wi/(kernel|bias) has shape"):
        to_hf(cfg.replace(d_ff=128), params, tmp_path)
    with pytest.raises(ValueError, match="missing lm_head/kernel"):
        to_hf(cfg, {k: v for k, v in params.items() if k != "lm_head"}, tmp_path)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """(HF folder, run dir): a GPT-2 of fresh random weights, made a run by from-hf (its
    step-0 checkpoint), for the CLI's bad-input errors."""
    from jaxformer.convert.__main__ import from_hf_run
    d = tmp_path_factory.mktemp("small")
    to_hf(*our_model("gpt2-untied"), d / "hf")
    from_hf_run(str(d / "hf"), str(d / "run"), log=lambda *a: None)
    return d / "hf", d / "run"


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and err.startswith("error: "), captured
    return err


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float8", "float64"])
def test_only_float_weight_dtypes_are_accepted(small_run, tmp_path, capsys, dtype):
    from jaxformer.convert.__main__ import main
    hf, run = small_run
    want = f"error: dtype {dtype} is not a weights dtype; pass one of float32, bfloat16, float16"
    assert main(["to-hf", str(run), str(tmp_path / "out"), "--dtype", dtype]) == 2
    assert one_line_error(capsys) == want and not (tmp_path / "out").exists()
    assert main(["from-hf", str(hf), str(tmp_path / "r"), "--dtype", dtype]) == 2
    assert one_line_error(capsys) == want and not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match=f"dtype {dtype} is not a weights dtype"):
        to_hf(*our_model("gpt2-untied"), tmp_path / "api", dtype=dtype)
    assert not (tmp_path / "api").exists()


def test_a_missing_step_names_the_saved_steps(small_run, tmp_path, capsys):
    from jaxformer.convert.__main__ import main
    from jaxformer.eval.loading import read_model
    _, run = small_run
    assert main(["to-hf", str(run / "checkpoints" / "99"), str(tmp_path / "out")]) == 2
    assert one_line_error(capsys) == f"error: {run} has no step 99; saved steps: 0"
    with pytest.raises(FileNotFoundError, match=rf"^{run} has no step 7; saved steps: 0$"):
        read_model(f"{run}@7")  # python -m jaxformer.eval RUN@7


def test_a_truncated_safetensors_file_is_one_line(small_run, tmp_path, capsys):
    import shutil
    from jaxformer.convert.__main__ import main
    folder = shutil.copytree(small_run[0], tmp_path / "hf")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:int(rng.integers(1000, len(data) - 1))])
    assert main(["from-hf", str(folder), str(tmp_path / "r")]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {folder / 'model.safetensors'} is incomplete or corrupt (")
    assert err.endswith("; download or save it again") and not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="model.safetensors is incomplete or corrupt"):
        from_hf(folder)


@pytest.mark.parametrize("mb", ["0", "-1"])
def test_max_shard_mb_must_be_positive(small_run, tmp_path, capsys, mb):
    from jaxformer.convert.__main__ import main
    assert main(["to-hf", str(small_run[1]), str(tmp_path / "out"), "--max-shard-mb", mb]) == 2
    assert one_line_error(capsys) == (f"error: --max-shard-mb must be > 0, got {mb}; leave it "
                                      "out for one model.safetensors")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=f"max_shard_bytes must be > 0, got {mb}"):
        to_hf(*our_model("gpt2-untied"), tmp_path / "api", max_shard_bytes=int(mb))


def test_from_hf_takes_every_runtime_setting_and_param_dtype_casts_the_weights(small_run,
                                                                              tmp_path, capsys):
    """model.config.RUNTIME (how a model runs, not what it computes) as from-hf overrides:
    model.matmul_precision and model.param_dtype too (they were refused as changing the
    weights); param_dtype is --dtype's setting (both at once must agree): the run's
    weights load in it."""
    from jaxformer.convert.__main__ import main
    from jaxformer.model.config import RUNTIME
    from jaxformer.training.saved_run import load_run

    hf, run = small_run[0], tmp_path / "r"
    assert main(["from-hf", str(hf), str(run), "model.matmul_precision=fp8",
                 "model.param_dtype=bfloat16", "model.remat=full"]) == 0
    model, params, _ = load_run(str(run))
    assert (model.cfg.matmul_precision, model.cfg.param_dtype) == ("fp8", "bfloat16")
    _, want = from_hf(hf)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert a.dtype == jax.numpy.bfloat16 and np.array_equal(a, np.asarray(b).astype(a.dtype))
    capsys.readouterr()
    assert main(["from-hf", str(hf), str(tmp_path / "r2"), "model.param_dtype=bfloat16",
                 "--dtype", "float16"]) == 2
    assert one_line_error(capsys) == ("error: --dtype float16 and model.param_dtype=bfloat16 "
                                      "name the params' dtype twice, differently; give one "
                                      "of them")
    assert main(["from-hf", str(hf), str(tmp_path / "r3"), "model.n_layers=1"]) == 2
    assert f"may set model.{', model.'.join(RUNTIME)}" in one_line_error(capsys)


def test_a_misspelled_override_is_refused_before_converting(small_run, tmp_path, capsys):
    from jaxformer.convert.__main__ import main
    assert main(["from-hf", str(small_run[0]), str(tmp_path / "r"), "trian.steps=3"]) == 2
    assert "trian" in one_line_error(capsys) and not (tmp_path / "r").exists()
