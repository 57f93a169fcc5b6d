"""DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (jaxformer.hf.mla_layout's
mtp_rules; the deepseek_v3 row of jaxformer.hf.families, glm4_moe's of jaxformer.hf.glm_layout):
transformers builds none (num_nextn_predict_layers or not), so a random one (std 0.1) is
written by hand beside a random model's tensors as layer n_layers (its block the last layer
of a random 3-layer model); from_hf reads it as model.mtp_depth=1, and its predictions equal
a float64 forward of the paper's module (enorm, hnorm, eh_proj over [embedding; hidden
state], the layer as transformers' decoder layer runs it, shared_head's norm and head);
to_hf writes it back tensor for tensor. A folder without the layer reads as mtp_depth=0
(from_hf, and read_hf_config from its tensor names)."""

import json


import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as glm  # noqa: E402

from jaxformer import Transformer  # noqa: E402
from jaxformer.convert import from_hf, read_hf_config, to_hf  # noqa: E402
from tests.hf.test_families import redraw, rel_err  # noqa: E402
from tests.hf.test_glm import GLM4_MOE, glm_model  # noqa: E402
from tests.hf.test_moe_families import V, hf_model  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
# model type: (a random 3-layer model, a sparse layer last; its RMSNorm class)
FAMILIES = {"deepseek_v3": (lambda: hf_model("deepseek_v3", num_hidden_layers=3,
                                             first_k_dense_replace=1), ds.DeepseekV3RMSNorm),
            "glm4_moe": (lambda: glm_model(**dict(GLM4_MOE, num_hidden_layers=3)),
                         glm.Glm4MoeRMSNorm)}


def mtp_parts(config, norm):
    """A random MTP module's own norms (at the model's epsilon) and projection (std 0.1;
    norms 1 + 0.1 noise)."""
    torch.manual_seed(int(rng.integers(1 << 31)))
    d, eps = config.hidden_size, config.rms_norm_eps
    parts = {"enorm": norm(d, eps), "hnorm": norm(d, eps), "shared_head.norm": norm(d, eps),
             "eh_proj": torch.nn.Linear(2 * d, d, bias=False)}
    for name, part in parts.items():
        redraw(part.named_parameters(), lambda _: "norm" in name)
    return parts


def reference(model, layer, parts, tokens):
    """Module 1's logits [B, T - 1, V] in float64: h^0 is the input of the model's final
    norm; position i reads the embedding of t_{i+1}."""
    model.set_experts_implementation("eager")  # (grouped_mm takes no float64)
    model, layer = model.double(), layer.double()
    parts = {k: p.double() for k, p in parts.items()}
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: seen.setdefault("h", i[0]))
    ids = torch.tensor(tokens)
    with torch.no_grad():
        model(ids)
        hook.remove()
        h, b, t = seen["h"][:, :-1], ids.shape[0], ids.shape[1] - 1
        emb = model.model.embed_tokens(ids[:, 1:])
        x = parts["eh_proj"](torch.cat([parts["enorm"](emb), parts["hnorm"](h)], -1))
        pos = torch.arange(t)[None].expand(b, t)
        mask = torch.full((t, t), -torch.inf, dtype=torch.float64).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=pos,
                  position_embeddings=model.model.rotary_emb(x, pos))
        return model.lm_head(parts["shared_head.norm"](x)).numpy()


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_mtp_layer_read_run_and_written(model_type, tmp_path):
    # a random 3-layer model: its last layer becomes the MTP module's block, the rest the model
    build, norm = FAMILIES[model_type]
    model = build()
    model.save_pretrained(tmp_path / "three")
    tensors = load_file(tmp_path / "three" / "model.safetensors")  # layer 2's under its names
    layer = model.model.layers[2]
    model.model.layers = torch.nn.ModuleList(list(model.model.layers[:2]))
    model.config.num_hidden_layers = 2
    model.save_pretrained(tmp_path / "plain")
    assert from_hf(tmp_path / "plain")[0].mtp_depth == 0  # transformers' own folder
    assert read_hf_config(tmp_path / "plain").mtp_depth == 0
    parts = mtp_parts(model.config, norm)
    tensors.update({f"model.layers.2.{k}.{w}": t.numpy() for k, p in parts.items()
                    for w, t in p.state_dict().items()})
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"]
    (tmp_path / "mtp").mkdir()
    keys = json.loads((tmp_path / "plain/config.json").read_text())
    keys["num_nextn_predict_layers"] = 1
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(keys))
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})

    cfg, params = from_hf(tmp_path / "mtp")
    assert cfg.mtp_depth == 1 == read_hf_config(tmp_path / "mtp").mtp_depth
    tokens = rng.integers(0, V, (2, 12))
    apply = jax.jit(lambda p, x: Transformer(cfg).apply({"params": p}, x, mtp=True))
    logits, more = apply(params, tokens)
    want = reference(model, layer, parts, tokens)
    assert rel_err(np.asarray(more[0, :, :-1]), want) < 1e-5, rel_err(more[0, :, :-1], want)

    written = to_hf(cfg, params, tmp_path / "out")
    assert (written["model_type"], written["num_nextn_predict_layers"]) == (model_type, 1)
    back = load_file(tmp_path / "out" / "model.safetensors")
    for name in (n for n in tensors if n.startswith("model.layers.2.")):
        np.testing.assert_allclose(back[name], tensors[name], rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    cfg2, params2 = from_hf(tmp_path / "out")
    np.testing.assert_allclose(apply(params2, tokens)[1], more, rtol=1e-6, atol=1e-6)
