"""Adapter-sized checkpoints (jaxformer.training.adapter_checkpoint): a LoRA run from an HF
folder saves its adapters and their optimizer state alone, resumes bitwise, is read by
generate and convert with the folder's weights, and refuses a base that moved or changed."""

import json
import shutil
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from jaxformer.training import load_config, train
from jaxformer.training.checkpoint import CheckpointError
from tests.training.test_loop import corpus, losses, restored_state  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TARGETS = {"query": "self_attn.q_proj", "wo": "mlp.down_proj"}  # ours -> HF's module
RUN = ["train.seq_len=32", "train.batch_size=2", "train.eval_batches=1", "train.progress=false",
       "train.sample_tokens=0", "train.log_every=1", "data.tokenizer=bytes", "train.steps=4",
       "checkpoint.every=2", "checkpoint.keep=5", "model.lora.rank=2", "model.lora.alpha=3",
       f"model.lora.targets={','.join(TARGETS)}", "optim.lr=3e-2", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus):  # noqa: F811
    """A random Llama saved by transformers (its weights 40x the adapters'), and a LoRA
    run of 4 steps from it, checkpointed at steps 2 and 4."""
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("lora_ckpt")
    transformers.LlamaForCausalLM(hf).save_pretrained(root / "base")
    cfg = load_config(None, [*RUN, f"data.path={corpus}", f"train.init_from={root / 'base'}",
                             f"train.run_dir={root / 'run'}", f"data.cache_dir={root / 'cache'}"])
    train(cfg, log=lambda *a: None)
    return types.SimpleNamespace(base=root / "base", run=root / "run", cfg=cfg)


def saved_tree(step_dir):
    """The train state a checkpoint step holds, as orbax reads it back without a target."""
    return ocp.StandardCheckpointer().restore(step_dir / "state")


def adapters_by_hand(run):
    """{HF weight name: float64 W + (alpha / r) A B in HF's [out, in] layout}, from the
    folder's safetensors and the adapters the checkpoint holds."""
    base = load_file(run.base / "model.safetensors")
    params = jax.device_get(saved_tree(run.run / "checkpoints/4")["params"])
    out = {}
    for i in range(2):
        for ours, theirs in TARGETS.items():
            group = "attn" if ours == "query" else "ffn"
            ad = params[f"block_{i}"][group][f"{ours}_lora"]
            a, b = np.float64(ad["lora_a"]), np.float64(ad["lora_b"])
            delta = 1.5 * a.reshape(-1, 2) @ b.reshape(2, -1)  # [in, out]; alpha / r = 3 / 2
            name = f"model.layers.{i}.{theirs}.weight"
            out[name] = base[name].astype(np.float64) + delta.T
    return base, out


def test_a_lora_checkpoint_holds_the_adapters_alone(lora_run):
    """Every saved param is an adapter's A, B or scale, with AdamW's two moments for A and B;
    the files of a step are under half the base's bytes, and its array data at most the
    adapters' bytes times 3 (A and B, and the moments)."""
    base_bytes = sum(x.nbytes for x in load_file(lora_run.base / "model.safetensors").values())
    step = lora_run.run / "checkpoints/4"
    tree = saved_tree(step)
    leaves = {jax.tree_util.keystr(p): x for p, x in
              jax.tree_util.tree_flatten_with_path(tree["params"])[0]}
    assert leaves and all(k.split("'")[-2] in ("lora_a", "lora_b", "lora_scale") for k in leaves)
    adapter_bytes = sum(x.nbytes for k, x in leaves.items() if "lora_scale" not in k)
    moments = [x for x in jax.tree.leaves(tree["opt_state"]) if x.ndim]
    assert sum(x.nbytes for x in moments) == 2 * adapter_bytes
    on_disk = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    data = [p.stat().st_size for p in (step / "state").rglob("*")
            if p.is_file() and p.parent.name == "d"]
    # orbax's own files and how many data files its writes made vary: 80-110 KB in all over
    # ten runs, against the base's 427 KB, which a step holding the base would exceed
    assert on_disk < base_bytes / 2, (on_disk, base_bytes)
    assert max(data) < 3 * adapter_bytes + 2048, (data, adapter_bytes)  # (orbax may compress)
    info = json.loads((step / "info/metadata").read_text())["base"]
    assert info["source"] == str(lora_run.base.resolve()) and len(info["sha256"]) == 64


def test_resume_from_adapters_alone_is_bitwise(lora_run, tmp_path):
    """The run's copy without its step-4 checkpoint resumes from step 2, joining the base
    read from the folder, and saves at step 4 bitwise what the uninterrupted run saved
    (adapters, moments, counters, rng), with the same losses on the way."""
    copy = tmp_path / "run"
    shutil.copytree(lora_run.run, copy)
    shutil.rmtree(copy / "checkpoints/4")
    cfg = load_config(str(copy / "config.yaml"), [f"train.run_dir={copy}"])
    summary = train(cfg, log=lambda *a: None)
    assert (summary["start_step"], summary["step"]) == (2, 4)
    want, got = saved_tree(lora_run.run / "checkpoints/4"), saved_tree(copy / "checkpoints/4")
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    a, b = losses(lora_run.run), losses(copy)
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]
    state = restored_state(cfg, copy)  # the whole model again: the folder's base as it was
    base = load_file(lora_run.base / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(state.params["block_1"]["attn"]["query"]["kernel"])
                                  .reshape(64, 64).T, base["model.layers.1.self_attn.q_proj.weight"])


def test_convert_and_generate_read_the_base_beside_the_adapters(lora_run, tmp_path):
    """to-hf writes the folder's weights with W + (alpha / r) A B folded into the targets
    (float64 NumPy, from the checkpoint's adapters); to-peft's A and B give that update by
    PEFT's formula; generate's model (load_run) gives the merged export's logits in transformers."""
    from jaxformer.convert.__main__ import main as convert
    from jaxformer.training.saved_run import load_run

    base, merged = adapters_by_hand(lora_run)
    assert convert(["to-hf", str(lora_run.run), str(tmp_path / "hf")]) == 0
    out = load_file(tmp_path / "hf/model.safetensors")
    assert set(out) == set(base)
    for name in base:
        if name in merged:
            assert not np.allclose(merged[name], base[name], rtol=0, atol=1e-5), name
            np.testing.assert_allclose(out[name], merged[name], rtol=1e-6, atol=1e-7,
                                       err_msg=name)
        else:
            np.testing.assert_array_equal(out[name], base[name], err_msg=name)
    assert convert(["to-peft", str(lora_run.run), str(tmp_path / "peft")]) == 0
    peft_cfg = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    tensors = load_file(tmp_path / "peft/adapter_model.safetensors")
    for name in merged:
        m = f"base_model.model.{name.removesuffix('.weight')}"
        update = np.float64(tensors[f"{m}.lora_B.weight"]) @ tensors[f"{m}.lora_A.weight"]
        np.testing.assert_allclose(peft_cfg["lora_alpha"] / peft_cfg["r"] * update,
                                   merged[name] - base[name], rtol=1e-5, atol=1e-8)
    model, params, _ = load_run(str(lora_run.run))
    tokens = np.random.default_rng().integers(0, 256, (2, 9))
    ours = np.asarray(model.apply({"params": params}, tokens))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(
            torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


def test_a_moved_or_changed_base_is_refused_in_one_line(lora_run, tmp_path, capsys):
    """The folder moved: reading the run names the recorded folder and that it is not
    found; pointed at the new place (train.init_from in config.yaml) the run reads as
    before. One tensor of that folder overwritten: generate, and resuming, stop with one
    line naming the recorded base and the changed one."""
    from jaxformer.generate import main as generate
    from jaxformer.training.saved_run import load_run_params

    copy, moved, changed = tmp_path / "run", tmp_path / "moved", tmp_path / "changed"
    shutil.copytree(lora_run.run, copy)
    before = load_run_params(copy)[1]
    shutil.move(lora_run.base, moved)
    try:
        with pytest.raises(CheckpointError) as e:
            load_run_params(copy)
        line = str(e.value)
        assert "\n" not in line and str(lora_run.base) in line and "not found" in line, line
        capsys.readouterr()
        assert generate(["--run", str(copy), "--prompt", "a"]) == 2
        assert capsys.readouterr().err.strip() == f"error: {line}"

        config = (copy / "config.yaml").read_text()
        (copy / "config.yaml").write_text(config.replace(f"init_from: {lora_run.base}\n",
                                                         f"init_from: {moved}\n"))
        after = load_run_params(copy)[1]
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

        shutil.copytree(moved, changed)
        tensors = load_file(changed / "model.safetensors")
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = tensors[name] + np.float32(1e-3)
        save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
        (copy / "config.yaml").write_text(config.replace(f"init_from: {lora_run.base}\n",
                                                         f"init_from: {changed}\n"))
        for read in (lambda: load_run_params(copy),
                     lambda: train(load_config(str(copy / "config.yaml"),
                                               [f"train.run_dir={copy}", "train.steps=5"]),
                                   log=lambda *a: None)):
            with pytest.raises(CheckpointError) as e:
                read()
            line = str(e.value)
            assert "\n" not in line and "changed" in line, line
            assert str(lora_run.base) in line and str(changed) in line, line
    finally:
        shutil.move(moved, lora_run.base)
