"""Section 9: decoding with multi-head latent attention against GQA of the same size:
configs/gpu_1b.yaml (d_model 2,048, 16 layers, 16 heads, GQA with 4 K/V heads) and the same
model with MLA in DeepSeek-V3's ratios to d_model (q_lora_rank 3d/8 = 768, kv_lora_rank
d/4 = 512, each head's query/key 128 + 64 rotary, value 128), both with bf16 params and
cache, generate() greedy at each of sizes.mla_batches (1 and 64): MLA decodes in the
absorbed form over its latent cache (kv_lora_rank + qk_rope_head_dim numbers per token
and layer, against GQA's 2 x 4 x 128). Per row: ms per decode step, tokens/s, the cache
bytes at full length, and the fraction of the memory roofline as section 4 counts it
(decoding.generate_row: param bytes + cache bytes read per step over the copy bandwidth
measured in the same run)."""

from __future__ import annotations

import json

from gpu_suite.decoding import bf16_model, generate_row
from gpu_suite.sizes import Sizes, first_line
from gpu_suite.train_step import train_models
from jaxformer import ModelConfig, count_params


def mla_of(cfg: ModelConfig) -> ModelConfig:
    """cfg with MLA in DeepSeek-V3's ratios to d_model (bench/decode.py --mla's)."""
    d, head = cfg.d_model, cfg.d_model // cfg.n_heads
    mla = dict(q_lora_rank=3 * d // 8, kv_lora_rank=d // 4, qk_nope_head_dim=head,
               qk_rope_head_dim=head // 2, v_head_dim=head)
    fields = {k: v for k, v in cfg.to_dict().items() if k not in ("head_dim", "n_kv_heads")}
    return ModelConfig.from_dict({**fields, "mla": mla})


def attention_models(sizes: Sizes) -> dict[str, ModelConfig]:
    """{name: config}: the 1B config (GQA) and its MLA twin."""
    _, gqa, _ = train_models(sizes)[1]
    return {"gqa": gqa, "mla": mla_of(gqa)}


def mla_decode_rows(sizes: Sizes, bandwidth: float, repeats: int) -> list[dict]:
    rows = []
    for kind, cfg in attention_models(sizes).items():
        try:
            model, params, param_bytes = bf16_model(cfg)
            for batch in sizes.mla_batches:
                row = generate_row(kind, model, params, param_bytes, batch, sizes, bandwidth,
                                   repeats)
                rows.append({**row, "params": count_params(cfg), "d_model": cfg.d_model,
                             "n_layers": cfg.n_layers})
                print("mla_decode row:", json.dumps(rows[-1]), flush=True)
        except Exception as e:
            rows.append({"model": kind, "status": first_line(e)})
    return rows
