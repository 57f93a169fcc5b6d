"""LoRA adapters out in PEFT's format: adapter_config.json and adapter_model.safetensors,
which ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base model that
``to_hf`` of the same run without its adapters writes.

The HF tensors are not always our kernels one to one: GPT-2 and Phi-3 fuse q|k|v (and
Phi-3 gate|up) into one weight, GPT-NeoX interleaves q, k, v per head, and the export
reorders rows for a RoPE layout. Every such rule is linear in our kernels and leaves
their input axes alone, so the HF weight's update is exactly B' A' with A' our adapters'
A stacked ([k r, in] for the k of ours that feed it) and B' = (rule applied to the
updates) A'^+ (A' has full row rank). A fused weight so gets rank k r (PEFT's
rank_pattern), and each module the alpha its adapters' lora_scale gives (alpha_pattern
where that is not model.lora.alpha). The factorisation is checked.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jaxformer.convert.hf import adapter_update, param_getter
from jaxformer.convert.hf_config import config_to_hf
from jaxformer.hf.families import MODEL_TYPES
from jaxformer.model import lora
from jaxformer.model.config import ModelConfig

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def to_peft(cfg: ModelConfig, params, path, *, rope_layout: str = "half",
            base_model: str | None = None, dtype="float32", model_type=None) -> dict:
    """Write the model's LoRA adapters as a PEFT adapter folder; returns its config.
    model_type: the base's (config_to_hf), its tensors' names and layout (ERNIE 4.5's
    interleaved q/k rows, where the model would otherwise be written as a Llama)."""
    if not cfg.lora.rank:
        raise ValueError("the model has no LoRA adapters (model.lora.rank is 0): export it "
                         "whole with to-hf")
    plain = cfg.replace(lora=lora.LoRAConfig(), scan_layers=False)
    row = MODEL_TYPES[config_to_hf(plain, model_type=model_type)["model_type"]]
    rules = row.tensor_rules(plain, row, rope_layout)
    raw, r = param_getter(cfg, params), cfg.lora.rank
    tensors, ranks, alphas = {}, {}, {}
    for rule in rules:
        adapted = [p for p in rule.ours if p[-1] == "kernel" and p[-2] in cfg.lora.projections()]
        if not adapted:
            continue
        updates = [adapter_update(raw, p) if p in adapted else np.zeros_like(raw(p), np.float64)
                   for p in rule.ours]
        scale = float(raw(lora.adapter_path(adapted[0], lora.SCALE)))  # PEFT's lora_alpha / r
        a = np.concatenate([np.float64(raw(lora.adapter_path(p, "lora_a"))).reshape(-1, r).T
                            for p in adapted])  # [k r, in]
        for name, w in zip(rule.hf, rule.to_hf(*updates)):
            module = name.removesuffix(".weight")
            w = w.T if row.fan_in_fan_out else w  # Conv1D weights are [in, out]
            b = w @ np.linalg.pinv(a)  # [out, k r]
            if np.max(np.abs(b @ a - w)) > 1e-9 * max(np.max(np.abs(w)), 1e-30):
                raise ValueError(f"{name}: its update is not (B A) over the adapters' A")
            for leaf, x in (("lora_A", a), ("lora_B", b / scale)):  # safetensors writes the
                tensors[f"base_model.model.{module}.{leaf}.weight"] = \
                    np.ascontiguousarray(x.astype(dtype))  # buffer: a transpose needs a copy
            ranks[module], alphas[module] = a.shape[0], scale * a.shape[0]
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
              "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
              "target_modules": sorted(ranks), "fan_in_fan_out": row.fan_in_fan_out,
              "bias": "none", "base_model_name_or_path": base_model, "inference_mode": True,
              "rank_pattern": {m: k for m, k in ranks.items() if k != r},
              "alpha_pattern": {m: a for m, a in alphas.items()
                                if not np.isclose(a, cfg.lora.alpha, rtol=1e-6, atol=0)},
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config

