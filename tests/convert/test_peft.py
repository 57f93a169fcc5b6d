"""LoRA adapters exported in PEFT's format (jaxformer.convert.peft) and loaded by peft onto
the base model exported by to_hf: the logits of the merged export."""

import json

import jax
import numpy as np
import pytest

from jaxformer.model import lora
from tests.convert.test_convert import init_params, our_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

CASES = {  # each exports as another HF tensor layout
    "llama": dict(n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False, scan_layers=True),
    "gpt2": dict(position="learned", max_seq_len=64),  # q|k|v fused in a Conv1D
    "gpt_neox": dict(lora={"targets": "query,value,wo"}),  # q, k, v interleaved per head
}


@pytest.mark.parametrize("name", CASES)
def test_peft_loads_the_adapters_as_the_merged_export(name, tmp_path):
    from jaxformer import ModelConfig
    from jaxformer.convert import to_hf
    from jaxformer.convert.peft import to_peft

    kw = CASES[name]
    cfg = ModelConfig(**{**dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4,
                                max_seq_len=64), **kw,
                         "lora": {"rank": 3, "alpha": 6.0, **kw.get("lora", {})}})
    # every leaf N(0, 0.1), but each adapter's scale its real alpha / rank (2): drawn near 0
    # it left the adapters no effect the negative control below could see
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.full_like(x, 2.0) if path[-1].key == "lora_scale" else x,
        init_params(cfg, std=0.1))
    base_cfg, base = cfg.replace(lora=lora.LoRAConfig()), lora.partition(params, scales=True)[2]
    assert to_hf(base_cfg, base, tmp_path / "base")["model_type"] == name
    to_hf(cfg, params, tmp_path / "merged")
    config = to_peft(cfg, params, tmp_path / "adapter")
    tokens = rng.integers(0, cfg.vocab_size, (2, 11))

    def logits(model):
        with torch.no_grad():
            return model(torch.tensor(tokens)).logits.numpy()

    load = transformers.AutoModelForCausalLM.from_pretrained
    merged = logits(load(tmp_path / "merged", dtype=torch.float32))
    plain = logits(load(tmp_path / "base", dtype=torch.float32))
    adapted = logits(peft.PeftModel.from_pretrained(load(tmp_path / "base", dtype=torch.float32),
                                                    tmp_path / "adapter"))
    ours = our_logits(cfg, params, tokens)
    scale = np.abs(merged).max()
    assert np.abs(merged - ours).max() < 1e-4 * scale  # the merged export is the model
    assert np.abs(adapted - merged).max() < 1e-5 * scale
    assert np.abs(plain - merged).max() > 0.1 * scale  # the adapters matter here
    fused = {"gpt2": 3, "gpt_neox": 2}.get(name)  # q|k|v in one weight: rank 3r (2r)
    assert (set(config["rank_pattern"].values()) == {3 * fused} if fused
            else not config["rank_pattern"])
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 3
