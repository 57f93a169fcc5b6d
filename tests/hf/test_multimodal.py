"""Multimodal folders (jaxformer.hf.multimodal: Gemma 3, Qwen3-VL, Mistral 3) against
transformers: a random tiny multimodal model (its text model with windows shorter than the
prompt, a one-layer vision tower) saved with save_pretrained, then

- read by from_hf: its text model gives the full multimodal model's logits on text alone
  (input_ids only) within 1e-5 relative, and one line on stderr names the skipped parts;
- written by to_hf as a text-only folder: transformers' causal-LM class reads the same
  logits, under the text model's own model type;
- its params changed (noise) and written back by to_hf(into=the folder), stacked: the copy
  loads as the multimodal model, whose text logits are ours, its vision tower and
  projector tensors untouched (the Mistral 3 folder sharded, with its index; Gemma 3's
  tied head saved beside the embedding, and written as the new embedding);
- the same from the command line (to-hf RUN OUT --into FOLDER);
- a folder whose text model jaxformer lacks, a write-back into a folder of another config or
  into a text-only folder: one ConfigError line (exit 2 on the command line).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxformer import ConfigError, Transformer, param_shapes  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from jaxformer.convert import __main__ as convert_cli  # noqa: E402
from jaxformer.model.layer_runs import stack_layers  # noqa: E402
from jaxformer.training.config import RunConfig  # noqa: E402
from tests.hf.test_families import COMMON, hf_logits, redraw, rel_err  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T, W = 96, 12, 4  # vocab, prompt length, every window (shorter than the prompt)
TEXT = dict(COMMON, vocab_size=V, num_hidden_layers=2, head_dim=16)
SIGLIP = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
FOLDERS = {  # model_type: (its config.json keys, the text model's model type, shard bytes)
    "gemma3": (dict(  # the head tied; the multimodal head applies no final soft-cap
        text_config=dict(TEXT, sliding_window=W, sliding_window_pattern=2,
                         query_pre_attn_scalar=24, final_logit_softcapping=5.0),
        vision_config=SIGLIP, mm_tokens_per_image=4), "gemma3_text", None),
    "qwen3_vl": (dict(  # interleaved MRoPE: plain RoPE for text
        text_config=dict(TEXT, rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3],
            mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=64, deepstack_visual_indexes=[0])), "qwen3", None),
    "mistral3": (dict(  # an untied head (language_model.lm_head.weight), sharded
        text_config=dict(TEXT, model_type="mistral", sliding_window=W),
        tie_word_embeddings=False, vision_config=dict(SIGLIP, head_dim=8)), "mistral", 60_000),
}
SKIPPED = {"gemma3": ("vision_tower.", "multi_modal_projector."),
           "qwen3_vl": ("model.visual.",), "mistral3": ("vision_tower.", "multi_modal_projector.")}


def multimodal_folder(model_type, folder):
    """A random multimodal model of `model_type` (weights of std 0.1, norms perturbed),
    saved at `folder`."""
    keys, _, shard = FOLDERS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.AutoModelForImageTextToText.from_config(
        config, attn_implementation="eager").eval()
    redraw(model.named_parameters(), lambda name: "norm" in name)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def save_tied_head(folder, head: str, embed: str):
    """The tied head saved beside the embedding, equal to it (as some checkpoints have it)."""
    file = folder / "model.safetensors"
    saved = tensors(folder)
    save_file(dict(saved, **{head: saved[embed].copy()}), str(file), metadata={"format": "pt"})


def tensors(folder) -> dict:
    """Every tensor of a folder's safetensors files, by name."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("model_type", list(FOLDERS))
def test_multimodal_folder_reads_and_writes_its_text_model(model_type, tmp_path, capsys):
    model = multimodal_folder(model_type, tmp_path / "mm")
    head, embed = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"
    if model.config.tie_word_embeddings:  # Gemma 3's: its copy must follow the embedding
        save_tied_head(tmp_path / "mm", head, embed)
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)  # the multimodal model, text alone
    capsys.readouterr()  # save_pretrained's progress bars
    cfg, params = from_hf(tmp_path / "mm")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(p in err[0] for p in SKIPPED[model_type]), err
    forward = jax.jit(Transformer(cfg).apply)  # compiled once, for both params
    assert rel_err(np.asarray(forward({"params": params}, prompts)), want) < 1e-5

    text_type = FOLDERS[model_type][1]
    assert to_hf(cfg, params, tmp_path / "text")["model_type"] == text_type
    text = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "text", attn_implementation="eager").eval()
    assert rel_err(hf_logits(text, prompts), want) < 1e-5

    noisy = jax.tree.map(lambda p: p + 0.05 * rng.standard_normal(p.shape, np.float32), params)
    written = to_hf(cfg.replace(scan_layers=True), stack_layers(noisy, cfg.n_layers),
                    tmp_path / "back", into=tmp_path / "mm")
    assert written == json.loads((tmp_path / "mm" / "config.json").read_text())
    back = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert rel_err(hf_logits(back, prompts), np.asarray(forward({"params": noisy}, prompts))) < 1e-5
    before, after = tensors(tmp_path / "mm"), tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert sorted(p.name for p in (tmp_path / "mm").iterdir()) == \
        sorted(p.name for p in (tmp_path / "back").iterdir())
    if model.config.tie_word_embeddings:
        assert np.array_equal(after[head], after[embed])
    for name, t in before.items():  # the skipped parts as they were, the text model not
        assert np.array_equal(after[name], t) == name.startswith(SKIPPED[model_type]), name


def write_config(folder, hf):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def test_refusals_are_one_line(tmp_path, capsys):
    """A text model jaxformer lacks (from_hf and the command line: exit 2); a write-back
    into a folder whose text model is another config, or into a text-only folder."""
    keys = FOLDERS["mistral3"][0]
    hf = dict(model_type="mistral3", architectures=["Mistral3ForConditionalGeneration"],
              **dict(keys, text_config=dict(keys["text_config"], model_type="ministral3")))
    with pytest.raises(ConfigError, match="ministral3") as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value) and "mistral3" in str(e.value)
    folder = write_config(tmp_path / "ministral", hf)
    assert convert_cli.main(["from-hf", str(folder), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ministral3" in err[0], err

    gemma = dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                 **FOLDERS["gemma3"][0])
    cfg = config_from_hf(gemma)
    for changed, what in ((cfg.replace(norm_eps=cfg.norm_eps * 2), "norm_eps"),
                          (cfg.replace(d_ff=2 * cfg.d_ff), "d_ff")):
        with pytest.raises(ConfigError, match=what) as e:
            to_hf(changed, param_shapes(changed), tmp_path / "out",
                  into=write_config(tmp_path / what, gemma))
        assert "\n" not in str(e.value) and "another config" in str(e.value)
    plain = dict(gemma["text_config"], model_type="gemma3_text",
                 architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ConfigError, match="not a multimodal"):
        to_hf(cfg, param_shapes(cfg), tmp_path / "out", into=write_config(tmp_path / "t", plain))
    assert not (tmp_path / "out").exists()


def test_command_line_writes_a_run_back_into_its_folder(tmp_path, monkeypatch):
    """to-hf RUN OUT --into FOLDER, the run a Qwen3-VL folder's text model: the copy's
    tensors are the folder's own (float32 both ways)."""
    multimodal_folder("qwen3_vl", tmp_path / "mm")
    cfg, params = from_hf(tmp_path / "mm")
    run = RunConfig.from_dict({"model": cfg.to_dict()})
    monkeypatch.setattr(convert_cli, "load_run_params", lambda path, best: (run, params, tmp_path))
    assert convert_cli.main(["to-hf", "RUN", str(tmp_path / "back"), "--into",
                             str(tmp_path / "mm")]) == 0
    before, after = tensors(tmp_path / "mm"), tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert all(np.array_equal(after[name], t) for name, t in before.items())
