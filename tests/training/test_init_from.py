"""Fine-tuning: train.init_from (an HF folder or a run) and LoRA runs through train.py's loop."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import load_file

from jaxformer.model import lora
from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, train
from tests.training.test_loop import corpus, restored_state  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RUN = ["train.seq_len=32", "train.batch_size=2", "train.eval_batches=1", "train.progress=false",
       "train.sample_tokens=0", "train.log_every=1"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random Llama (GQA, untied) saved by transformers, with a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.BPE(vocab={chr(c): i for i, c in enumerate(range(32, 127))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def run_config(corpus, run_dir, *extra):  # noqa: F811
    return load_config(None, [*RUN, f"data.path={corpus}", f"train.run_dir={run_dir}",
                              f"data.cache_dir={run_dir.parent / 'cache'}", *extra])


def test_a_run_from_an_hf_folder_at_lr_0_exports_the_folder_exactly(hf_llama, corpus, tmp_path):  # noqa: F811
    from jaxformer.convert.__main__ import to_hf_run
    cfg = run_config(corpus, tmp_path / "run", f"train.init_from={hf_llama}", "train.steps=1",
                     "optim.warmup_steps=5", "data.tokenizer=bytes")  # lr 0 at step 0
    assert (cfg.model.d_model, cfg.model.n_kv_heads, cfg.model.ffn) == (32, 2, "swiglu")
    train(cfg, log=lambda *a: None)
    assert int(restored_state(cfg, tmp_path / "run").step) == 1
    to_hf_run(str(tmp_path / "run"), str(tmp_path / "out"), log=lambda *a: None)
    theirs, ours = load_file(hf_llama / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert set(theirs) == set(ours)
    for k in theirs:
        assert np.array_equal(theirs[k], ours[k]), k
    tokens = torch.tensor(np.random.default_rng().integers(0, 256, (2, 9)))
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        assert torch.equal(load(hf_llama).eval()(tokens).logits,
                           load(tmp_path / "out").eval()(tokens).logits)


def test_init_from_takes_the_folders_model_and_tokenizer_and_refuses_shape_changes(hf_llama):
    cfg = load_config(None, [f"train.init_from={hf_llama}", "model.remat=full",
                             "model.lora.rank=4", "model.scan_layers=true"])
    assert cfg.data.tokenizer == str(hf_llama / "tokenizer.json")
    assert (cfg.model.n_layers, cfg.model.remat, cfg.model.lora.rank) == (2, "full", 4)
    with pytest.raises(ConfigError, match=r"model.d_model=64 differs from 32 in train.init_from"):
        load_config(None, [f"train.init_from={hf_llama}", "model.d_model=64"])
    with pytest.raises(ConfigError, match=r"model.norm='layernorm' differs from 'rmsnorm'"):
        load_config(None, [f"train.init_from={hf_llama}", "model.norm=layernorm"])
    with pytest.raises(ConfigError, match="drop model.preset"):
        load_config(None, [f"train.init_from={hf_llama}", "model.preset=gpt2-small"])
    with pytest.raises(ConfigError, match="neither a Hugging Face model folder"):
        load_config(None, [f"train.init_from={hf_llama}/nothing"])


def test_a_run_from_a_runs_step_with_lora_starts_from_its_weights(corpus, tmp_path):  # noqa: F811
    """Run A (scanned) for 3 steps; run B from A@2, unscanned, with LoRA: at lr 0 its base
    is A's step-2 params, its adapters are new (B = 0), its step counter and optimizer
    start over (moments for the adapters only); at the end its merged weights differ from
    A@2 in the target kernels only."""
    a = run_config(corpus, tmp_path / "a", "model.preset=tiny", "model.d_model=32",
                   "model.n_layers=2", "model.scan_layers=true", "train.steps=3",
                   "checkpoint.every=1", "checkpoint.keep=5")
    train(a, log=lambda *m: None)
    b = run_config(corpus, tmp_path / "b", f"train.init_from={tmp_path / 'a'}@2",
                   "train.steps=2", "optim.warmup_steps=1", "model.scan_layers=false",
                   "model.lora.rank=2", "model.lora.targets=query,wo", "checkpoint.every=1")
    train(b, log=lambda *m: None)
    want = flatten_dict(jax.device_get(restored_state(a, tmp_path / "a", step=2).params))
    first = restored_state(b, tmp_path / "b", step=1)  # lr 0 at its first step
    adapters, _, base = (flatten_dict(jax.device_get(t))
                         for t in lora.partition(first.params, scales=True))
    got = base
    for k, v in got.items():
        if k[0].startswith("block_"):
            np.testing.assert_array_equal(v, want[("blocks",) + k[1:]][int(k[0][6:])], str(k))
        else:
            np.testing.assert_array_equal(v, want[k], str(k))
    assert {k[-2] for k in adapters} == {"query_lora", "wo_lora"}
    assert all(not v.any() for k, v in adapters.items() if k[-1] == "lora_b")
    assert int(first.step) == 1
    moments = [x for x in jax.tree.leaves(first.opt_state) if x.ndim]
    assert sum(x.size for x in moments) == 2 * sum(v.size for v in adapters.values())
    last = restored_state(b, tmp_path / "b")
    merged = flatten_dict(lora.merge(last.params))
    moved = {k[-2] for k in merged if not np.array_equal(merged[k], got[k])}
    assert moved == {"query", "wo"}
    assert json.loads((tmp_path / "b/metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_lora_on_prompt_completion_records_end_to_end(hf_llama, tmp_path):
    """HF folder in (its tokenizer), LoRA, prompt/completion records, then the adapters out
    as PEFT's folder and the merged model as HF's: peft on the base gives the merged
    export's logits."""
    peft = pytest.importorskip("peft")
    from jaxformer.convert.__main__ import main
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    gen = np.random.default_rng()
    records = [{"prompt": " ".join(gen.choice(words, 3)) + " :", "completion": " " + w}
               for w in gen.choice(words, 60)]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    cfg = run_config(data, tmp_path / "run", f"train.init_from={hf_llama}", "train.steps=3",
                     "data.format=prompt_completion", "model.lora.rank=4", "optim.lr=1e-2",
                     "optim.warmup_steps=0", "train.batch_size=4", "data.val_fraction=0.2")
    assert cfg.data.tokenizer == str(hf_llama / "tokenizer.json")
    summary = train(cfg, log=lambda *a: None)
    assert np.isfinite(summary["val_loss"])
    assert main(["to-peft", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    assert main(["to-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    adapter_cfg = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(hf_llama)
    load = transformers.AutoModelForCausalLM.from_pretrained
    tokens = torch.tensor(gen.integers(0, 95, (2, 9)))
    with torch.no_grad():
        merged = load(tmp_path / "merged").eval()(tokens).logits
        adapted = peft.PeftModel.from_pretrained(load(hf_llama), tmp_path / "adapter").eval()(
            tokens).logits
        base = load(hf_llama).eval()(tokens).logits
    assert torch.allclose(adapted, merged, rtol=1e-5, atol=1e-5 * float(merged.abs().max()))
    assert not torch.allclose(base, merged, atol=1e-4)  # three steps moved the adapters


def test_a_run_from_a_run_with_adapters_starts_from_its_merged_weights(tmp_path, rng):
    """A run dir whose checkpoint holds trained adapters (random A and B, scanned layers):
    a run from it, unscanned and without adapters, starts from W + (alpha / r) A B for each
    target kernel, written out in float64 NumPy, and from the source's other params as
    they are."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxformer import Transformer
    from jaxformer.core.sharding import make_mesh, resolve_rules
    from jaxformer.training.checkpoint import Checkpointer
    from jaxformer.training.initial_weights import load_initial
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import abstract_state

    model = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
             "model.max_seq_len=32", "model.scan_layers=true", "model.lora.rank=3",
             "model.lora.alpha=5", "model.lora.targets=query,out,wi,wo"]
    a = load_config(None, [*model, f"train.run_dir={tmp_path / 'a'}"])
    (tmp_path / "a").mkdir()
    (tmp_path / "a/config.yaml").write_text(yaml.safe_dump(a.to_dict(), sort_keys=False))
    tx, _ = make_optimizer(a.optim, a.model, a.train.steps)
    state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                         abstract_state(Transformer(a.model), tx))
    params = {k: np.full(v.shape, 5 / 3, np.float32) if k[-1] == "lora_scale" else
              (rng.standard_normal(v.shape) * 0.3).astype(np.float32)
              for k, v in flatten_dict(state.params).items()}
    ckpt = Checkpointer(tmp_path / "a", keep=1, async_save=False)
    ckpt.save(4, state.replace(params=unflatten_dict(params)), a.model)
    ckpt.close()

    b = load_config(None, [f"train.init_from={tmp_path / 'a'}", "model.scan_layers=false",
                           f"train.run_dir={tmp_path / 'b'}"])
    assert not b.model.lora.rank and not b.model.scan_layers
    mesh, rules = make_mesh(1, 1, 1), resolve_rules(b.mesh.rules)
    fresh = jax.eval_shape(Transformer(b.model).init, jax.random.key(0),
                           jnp.zeros((1, 8), jnp.int32))["params"]
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), fresh)  # one device
    got = flatten_dict(jax.device_get(load_initial(str(tmp_path / "a"), b.model, fresh,
                                                   shardings, mesh, rules, log=lambda *m: None)))
    want = {}
    for k, v in params.items():
        if k[-2].endswith("_lora"):
            continue
        for i in range(2) if k[0] == "blocks" else [None]:
            key = (f"block_{i}",) + k[1:] if i is not None else k
            want[key] = np.float64(v if i is None else v[i])
            if k[-1] == "kernel" and k[-2] in ("query", "out", "wi", "wo"):
                lora_a = params[k[:-2] + (k[-2] + "_lora", "lora_a")][i]
                lora_b = params[k[:-2] + (k[-2] + "_lora", "lora_b")][i]
                delta = lora_a.reshape(-1, 3).astype(np.float64) @ lora_b.reshape(3, -1)
                want[key] += 5 / 3 * delta.reshape(want[key].shape)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=str(k))


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_init_from_refuses_another_max_seq_len_for_a_learned_table_alone(position, tmp_path):
    """A learned position table has max_seq_len rows: a run from such weights that sets
    another max_seq_len (longer or shorter) is refused in one line naming the field, the
    same one accepted; RoPE has no table, so its max_seq_len may change."""
    source = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1",
                                "model.n_heads=4", "model.max_seq_len=32",
                                f"model.position={position}", "train.seq_len=16"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(source.to_dict(), sort_keys=False))
    run = lambda n: load_config(None, [f"train.init_from={tmp_path}",  # noqa: E731
                                       f"model.max_seq_len={n}", "train.seq_len=16"])
    assert run(32).model.max_seq_len == 32
    for n in (64, 16):
        if position == "rope":
            cfg = run(n)
            assert (cfg.model.max_seq_len, cfg.model.position) == (n, "rope")
            continue
        with pytest.raises(ConfigError) as e:
            run(n)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"model.max_seq_len={n} differs from 32 in train.init_from="), msg
        assert "model.max_seq_len" not in msg.split("may set only")[1].split("(")[0], msg


def test_a_run_from_a_hybrid_model_may_set_its_mixers_chunk_alone(tmp_path, rng):
    """A gated delta-rule hybrid's chunk length (how its training form runs) may be set by
    a run from its weights, written or not in the source's config; another setting of the
    mixer (its heads) is refused in one line naming the field and both values."""
    source = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2",
                                "model.n_heads=2", "model.position=none",
                                "model.layer_pattern=d,a", "model.layer_kinds.d.mixer=gated_delta",
                                "model.layer_kinds.a.ffn=true", "train.seq_len=16"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(source.to_dict(), sort_keys=False))
    chunk = int(rng.integers(1, 60))
    cfg = load_config(None, [f"train.init_from={tmp_path}", "train.seq_len=16",
                             f"model.mixer.gated_delta.chunk={chunk}"])
    assert cfg.model.mixer_settings("gated_delta").chunk == chunk
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"train.init_from={tmp_path}", "train.seq_len=16",
                           "model.mixer.gated_delta.heads=2"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.mixer.gated_delta.heads=2 differs from 4 "
                                              f"in train.init_from={tmp_path}"), msg
    assert "model.mixer.gated_delta.chunk" in msg.split("may set only")[1], msg


def test_an_encoder_decoder_run_starts_a_scanned_one_from_its_weights(tmp_path, rng):
    """A run dir of an encoder-decoder (per-layer; random params, 3 encoder and 2 decoder
    layers): a run from it with scan_layers=true starts from its weights, each stack's
    layers stacked in order under encoder/blocks and decoder/blocks, the rest as they are."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxformer.core.sharding import make_mesh, resolve_rules
    from jaxformer.model.build import model_for
    from jaxformer.training.checkpoint import Checkpointer
    from jaxformer.training.initial_weights import load_initial
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import abstract_state

    model = ["model.arch=encoder_decoder", "model.vocab_size=64", "model.d_model=16",
             "model.n_layers=2", "model.encoder_layers=3", "model.n_heads=2",
             "model.max_seq_len=32", "model.position=t5", "data.format=seq2seq",
             "data.path=pairs.jsonl"]
    a = load_config(None, [*model, f"train.run_dir={tmp_path / 'a'}"])
    (tmp_path / "a").mkdir()
    (tmp_path / "a/config.yaml").write_text(yaml.safe_dump(a.to_dict(), sort_keys=False))
    tx, _ = make_optimizer(a.optim, a.model, a.train.steps)
    state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                         abstract_state(model_for(a.model), tx))
    params = {k: rng.standard_normal(v.shape).astype(np.float32)
              for k, v in flatten_dict(state.params).items()}
    ckpt = Checkpointer(tmp_path / "a", keep=1, async_save=False)
    ckpt.save(3, state.replace(params=unflatten_dict(params)), a.model)
    ckpt.close()

    b = load_config(None, [f"train.init_from={tmp_path / 'a'}", "model.scan_layers=true",
                           "data.format=seq2seq", "data.path=pairs.jsonl",
                           f"train.run_dir={tmp_path / 'b'}"])
    assert b.model.scan_layers and b.model.arch == "encoder_decoder"
    mesh, rules = make_mesh(1, 1, 1), resolve_rules(b.mesh.rules)
    fresh = jax.eval_shape(model_for(b.model).init, jax.random.key(0),
                           jnp.zeros((1, 8), jnp.int32))["params"]
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), fresh)  # one device
    got = flatten_dict(jax.device_get(load_initial(str(tmp_path / "a"), b.model, fresh,
                                                   shardings, mesh, rules, log=lambda *m: None)))
    want = {k: v for k, v in params.items() if not k[1].startswith("block_")}
    for stack, n in (("encoder", 3), ("decoder", 2)):
        for k in params:
            if k[:2] == (stack, "block_0"):
                want[(stack, "blocks") + k[2:]] = np.stack(
                    [params[(stack, f"block_{i}") + k[2:]] for i in range(n)])
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_a_folder_whose_weights_or_config_json_do_not_fit_is_a_config_error(hf_llama, corpus,  # noqa: F811
                                                                            tmp_path):
    """train.init_from of a folder whose tensors do not fit its config.json, or whose
    config.json is not JSON, is a ConfigError (train.py's one line), not a traceback."""
    import json
    import shutil
    folder = tmp_path / "llama"
    shutil.copytree(hf_llama, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "intermediate_size": 96}))
    cfg = run_config(corpus, tmp_path / "run", f"train.init_from={folder}", "train.steps=1",
                     "data.tokenizer=bytes")
    with pytest.raises(ConfigError, match=r"has shape \[64, 32\], but config.json implies "
                                          r"\[96, 32\]"):
        train(cfg, log=lambda *a: None)
    (folder / "config.json").write_text("{'model_type': 'llama'}")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_config(None, [f"train.init_from={folder}"])
