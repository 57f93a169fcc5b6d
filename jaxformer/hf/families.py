"""One row per Hugging Face model_type: everything jaxformer knows of it, and the only place
a model type is named (tests/test_layout.py); the rest of jaxformer asks its row.

A row gives the architectures read, the defaults of config.json keys, where it comes in
the order to_hf tries model types, and its format: a config.json reader and writer and
tensor rules, the Llama layout's (jaxformer.hf.llama_layout) unless the layout is its own
(GPT-2, GPT-NeoX), with the Llama lineage's twists as fields, and a mixture of experts'
keys and tensors as its `moe` (jaxformer.hf.moe_layout). Adding a Llama-layout family is
adding a row.

The defaults are those of transformers 5's config classes (save_pretrained writes them all,
so they matter only for hand-written files), except for the sizes (vocab, width, depth,
heads, MLP, experts, GPT-2's position table): a config.json without one of them is an error rather
than a 7B-sized guess.
"""

from __future__ import annotations

from jaxformer.hf import (afmoe_layout, apertus_layout, bart, bert, ernie_layout,
                          falcon_h1_layout, gated_delta_layout, glm_layout, gpt2, gpt_neox,
                          hunyuan_layout, lfm2_layout, llama4_layout, mamba2_layout,
                          minimax_layout, multimodal, nemotron_layout, scales, seed_oss_layout,
                          t5, twists)
from jaxformer.hf import llama_layout, mla_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.model.kinds import CLAMP_ALPHA, CLAMP_LIMIT


# ---- the rows ----------------------------------------------------------------------------

MODEL_TYPES: dict[str, HFModelType] = {row.name: row for row in [
    HFModelType(
        "gpt2", ("GPT2LMHeadModel", "GPT2Model"), export_rank=0,
        defaults=dict(n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                      scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                      reorder_and_upcast_attn=False, add_cross_attention=False,
                      tie_word_embeddings=True),
        read_config=gpt2.read_config, write_config=gpt2.write_config,
        tensor_rules=gpt2.tensor_rules, tensor_prefix="transformer.", fan_in_fan_out=True,
        ignored_tensors=gpt2.BUFFERS),
    HFModelType(
        "llama", ("LlamaForCausalLM", "LlamaModel"), export_rank=2,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, head_dim=None, rope_theta=10000.0)),
    HFModelType(
        "mistral", ("MistralForCausalLM", "MistralModel"), export_rank=3,
        defaults=dict(num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
                      sliding_window=4096, rope_theta=10000.0),
        biases="none", layer_type=twists.all_sliding),
    HFModelType(
        "qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), export_rank=4,
        defaults=dict(num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                      layer_types=None, rope_theta=10000.0),
        biases="qkv", layer_type=twists.qwen_types, layer_types_key=True, use_sliding_window=True),
    HFModelType(
        # rotary_pct / rotary_emb_base: transformers 4.x's keys, still read by 5 when
        # rope_parameters lacks partial_rotary_factor / rope_theta
        "gpt_neox", ("GPTNeoXForCausalLM", "GPTNeoXModel"), export_rank=1,
        defaults=dict(hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5,
                      tie_word_embeddings=False, use_parallel_residual=True,
                      attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000.0),
        read_config=gpt_neox.read_config, write_config=gpt_neox.write_config,
        tensor_rules=gpt_neox.tensor_rules, tensor_prefix="gpt_neox.",
        head_tensor="embed_out.weight", rotary_fraction_key="rotary_pct",
        ignored_tensors=gpt_neox.BUFFERS),
    HFModelType(
        "qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), export_rank=5,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      head_dim=128, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, rope_theta=10000.0),
        qk_norm="head", biases="attention", layer_type=twists.qwen_types, layer_types_key=True,
        use_sliding_window=True),
    HFModelType(
        # Phi3Config takes only default RoPE or longrope (it reads yarn and su as longrope)
        "phi3", ("Phi3ForCausalLM", "Phi3Model"), export_rank=6,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                      head_dim=None, rope_theta=10000.0),
        biases="none", fused_projections=True, layer_type=twists.all_sliding,
        rotary_fraction_key="partial_rotary_factor", rope_scalings=("none",)),
    HFModelType(
        "smollm3", ("SmolLM3ForCausalLM", "SmolLM3Model"), export_rank=7,
        defaults=dict(num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                      mlp_bias=False, head_dim=None, use_sliding_window=False,
                      sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4,
                      rope_theta=2000000.0),
        layer_type=twists.smollm3_types, layer_types_key=True, use_sliding_window=True,
        rope_of=twists.smollm3_rope, extra_to_hf=twists.smollm3_to_hf),
    HFModelType(
        "granite", ("GraniteForCausalLM", "GraniteModel"), export_rank=8,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, head_dim=None, embedding_multiplier=1.0,
                      residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0,
                      rope_theta=10000.0),
        extra=scales.granite, extra_to_hf=scales.granite_to_hf),
    HFModelType(
        "olmo2", ("Olmo2ForCausalLM", "Olmo2Model"), export_rank=9,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      head_dim=None, rope_theta=10000.0),
        block="res_post_ln", qk_norm="projection", biases="attention"),
    HFModelType(
        "olmo3", ("Olmo3ForCausalLM", "Olmo3Model"), export_rank=10,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      head_dim=None, sliding_window=4096),
        block="res_post_ln", qk_norm="projection", biases="attention",
        layer_type=twists.global_every(4), layer_types_key=True,
        rope_per_type=dict(defaults={"full_attention": 5e5, "sliding_attention": 5e5},
                           legacy={"rope_theta": "full_attention"})),
    HFModelType(
        "gemma", ("GemmaForCausalLM", "GemmaModel"), export_rank=11,
        defaults=dict(num_key_value_heads=16, hidden_act="gelu_pytorch_tanh", head_dim=256,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, use_bidirectional_attention=None, rope_theta=10000.0,
                      query_pre_attn_scalar=None),
        **twists.GEMMA, act_aliases={"gelu": "gelu_pytorch_tanh"},  # as GemmaConfig rewrites it
        extra=scales.gemma, extra_to_hf=scales.gemma_to_hf),
    HFModelType(
        "gemma2", ("Gemma2ForCausalLM", "Gemma2Model"), export_rank=12,
        defaults=dict(num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh", head_dim=256,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                      use_bidirectional_attention=None, rope_theta=10000.0),
        **twists.GEMMA, block="sandwich", act_key="hidden_activation",
        layer_type=twists.global_every(2), layer_types_key=True, extra=scales.gemma2, extra_to_hf=scales.gemma2_to_hf),
    HFModelType(
        "gemma3_text", ("Gemma3ForCausalLM", "Gemma3TextModel"), export_rank=13,
        defaults=dict(num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh",
                      head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
                      sliding_window=4096, sliding_window_pattern=6, final_logit_softcapping=None,
                      use_bidirectional_attention=False),
        **twists.GEMMA, block="sandwich", qk_norm="head", act_key="hidden_activation",
        layer_type=twists.global_every(6, "sliding_window_pattern"), layer_types_key=True,
        extra=scales.gemma3, extra_to_hf=scales.gemma3_to_hf,
        rope_per_type=dict(defaults={"full_attention": 1e6, "sliding_attention": 1e4},
                           legacy={"rope_theta": "full_attention",
                                   "rope_local_base_freq": "sliding_attention"})),
    HFModelType(
        # rotates its sliding layers alone (the full-attention layers are NoPE), in adjacent
        # pairs (2i, 2i+1)
        "cohere2", ("Cohere2ForCausalLM", "Cohere2Model"), export_rank=14,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=8192,
                      layer_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
                      head_dim=None, sliding_window=4096, sliding_window_pattern=4,
                      logit_scale=0.0625, rope_theta=10000.0),
        norm="layernorm", block="parallel_shared_ln", biases="attention",
        eps_key="layer_norm_eps", rope_layout="interleaved",
        layer_type=twists.global_every(4, "sliding_window_pattern"), layer_types_key=True,
        rope_of=twists.sliding_rotated,
        extra=lambda get: dict(logits_multiplier=float(get("logit_scale"))),
        extra_to_hf=lambda cfg: dict(logit_scale=cfg.logits_multiplier)),
    HFModelType(
        # EXAONE 4.0: norms after each sublayer and QK-norm per head; 3 sliding : 1 global
        # layers, the global ones NoPE (every layer rotated when there is no window)
        "exaone4", ("Exaone4ForCausalLM", "Exaone4Model"), export_rank=15,
        defaults=dict(num_key_value_heads=32, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, head_dim=None,
                      sliding_window=4096, sliding_window_pattern=4, rope_theta=10000.0),
        block="res_post_ln", qk_norm="head", biases="none",
        layer_type=twists.global_every(4, "sliding_window_pattern"), layer_types_key=True,
        rope_of=lambda get, i, layer_type: (layer_type == "sliding_attention"
                                            or get("sliding_window") is None)),
    HFModelType(
        # the mixtures of experts: jaxformer.hf.moe_layout reads the experts' keys and tensors
        "mixtral", ("MixtralForCausalLM", "MixtralModel"), export_rank=16,
        defaults=dict(num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, head_dim=None,
                      sliding_window=None, rope_theta=1e6, num_experts_per_tok=2,
                      router_jitter_noise=0.0, **twists.ROUTER_LOSS),
        biases="none", layer_type=twists.all_sliding,
        moe=MoEFormat("block_sparse_moe", "gate", ("num_local_experts", "num_experts"),
                      "topk_softmax", expert_tensors=("w1", "w3", "w2")),
        refuse=(("router_jitter_noise", (0,), "jaxformer's router has no jitter noise"),)),
    HFModelType(
        "qwen3_moe", ("Qwen3MoeForCausalLM", "Qwen3MoeModel"), export_rank=17,
        defaults=dict(num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      head_dim=None, use_sliding_window=False, sliding_window=4096,
                      rope_theta=10000.0, num_experts_per_tok=8, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=None, **twists.ROUTER_LOSS),
        qk_norm="head", biases="attention", layer_type=twists.sliding_if_used,
        use_sliding_window=True,
        moe=MoEFormat("mlp", "gate", ("num_experts", "num_local_experts"), "softmax_topk",
                      "norm_topk_prob", "moe_intermediate_size", sparse_layers=True)),
    HFModelType(
        "olmoe", ("OlmoeForCausalLM", "OlmoeModel"), export_rank=18,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      head_dim=None, rope_theta=10000.0, clip_qkv=None, num_experts_per_tok=8,
                      norm_topk_prob=False, **dict(twists.ROUTER_LOSS, router_aux_loss_coef=0.01)),
        qk_norm="projection", biases="attention", extra_to_hf=twists.olmoe_to_hf,
        moe=MoEFormat("mlp", "gate", ("num_experts", "num_local_experts"), "softmax_topk",
                      "norm_topk_prob"),
        refuse=(("clip_qkv", (None,), "jaxformer does not clip q, k and v"),)),
    HFModelType(
        "qwen2_moe", ("Qwen2MoeForCausalLM", "Qwen2MoeModel"), export_rank=19,
        defaults=dict(num_key_value_heads=16, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None, qkv_bias=True,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                      layer_types=None, rope_theta=10000.0, num_experts_per_tok=4,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=None,
                      **twists.ROUTER_LOSS),
        biases="qkv_bias", layer_type=twists.qwen2_moe_types, layer_types_key=True,
        use_sliding_window=True,
        moe=MoEFormat("mlp", "gate", ("num_experts",), "softmax_topk", "norm_topk_prob",
                      "moe_intermediate_size", sparse_layers=True, shared_expert=True)),
    HFModelType(
        # Granite's multipliers; its router's softmax over the top-k logits is topk_softmax
        "granitemoe", ("GraniteMoeForCausalLM", "GraniteMoeModel"), export_rank=20,
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      head_dim=None, embedding_multiplier=1.0, residual_multiplier=1.0,
                      attention_multiplier=1.0, logits_scaling=1.0, rope_theta=10000.0,
                      num_experts_per_tok=2, **twists.ROUTER_LOSS),
        biases="attention", extra=scales.granite, extra_to_hf=scales.granite_to_hf,
        moe=MoEFormat("block_sparse_moe", "router.layer", ("num_local_experts",),
                      "topk_softmax", stacked=("input_linear", "output_linear"))),
    HFModelType(
        # multi-head latent attention (V2-Lite: no query LoRA), softmax routing greedy or by
        # groups (each group's best expert), the first layers dense, shared experts
        "deepseek_v2", ("DeepseekV2ForCausalLM", "DeepseekV2Model"), export_rank=22,
        defaults=dict(twists.DEEPSEEK, max_position_embeddings=2048, num_experts_per_tok=None,
                      n_shared_experts=2, routed_scaling_factor=1.0, n_group=None,
                      topk_group=None, topk_method="greedy", first_k_dense_replace=0,
                      norm_topk_prob=False, mlp_bias=False),
        biases="none", mla=True,
        refuse=twists.DEEPSEEK_REFUSE + (("mlp_bias", (False,), "jaxformer's MLP here has no "
                                          "biases"),),
        moe=MoEFormat("mlp", "gate", ("n_routed_experts", "num_experts"), "softmax_topk", None,
                      "moe_intermediate_size", first_dense_key="first_k_dense_replace",
                      shared_count_key="n_shared_experts", groups=twists.v2_groups,
                      groups_to_hf=twists.v2_groups_to_hf, scale_key="routed_scaling_factor")),
    HFModelType(
        # DeepSeek-V3 and Kimi K2: MLA with a low-rank query, sigmoid routing with the
        # selection bias, group-limited (each group's best two), renormalised and scaled
        "deepseek_v3", ("DeepseekV3ForCausalLM", "DeepseekV3Model"), export_rank=23,
        defaults=dict(twists.DEEPSEEK, num_experts_per_tok=8, n_shared_experts=1,
                      routed_scaling_factor=2.5, n_group=8, topk_group=4,
                      first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True,
                      num_nextn_predict_layers=1),
        biases="none", mla=True, tensor_rules=mla_layout.with_mtp(llama_layout.tensor_rules),
        extra=mla_layout.mtp_keys, extra_to_hf=lambda c: dict(num_nextn_predict_layers=c.mtp_depth),
        refuse=twists.DEEPSEEK_REFUSE + (("rope_interleave", (True,), "jaxformer reads DeepSeek's "
                                    "rotary weights with their pairs interleaved"),),
        extra_layers="DeepSeek-V3's multi-token-prediction layers past num_nextn_predict_layers "
        "(or without eh_proj), which jaxformer does not read",
        moe=MoEFormat("mlp", "gate", ("n_routed_experts", "num_local_experts"), "sigmoid",
                      "norm_topk_prob", "moe_intermediate_size",
                      first_dense_key="first_k_dense_replace", shared_count_key="n_shared_experts",
                      groups=lambda get: (get("n_group") or 1, get("topk_group") or 1),
                      groups_to_hf=lambda m: dict(n_group=m.groups, topk_group=m.topk_groups),
                      scale_key="routed_scaling_factor")),
    HFModelType(
        # attention sinks and biases, 1 sliding : 1 full layers, YaRN (truncate false), the
        # clamped SwiGLU experts with biases, fused and interleaved; softmax over the top-k
        "gpt_oss", ("GptOssForCausalLM", "GptOssModel"), export_rank=21,
        defaults=dict(num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
                      head_dim=64, sliding_window=128, layer_types=None, rope_theta=150000.0,
                      num_experts_per_tok=4, swiglu_alpha=CLAMP_ALPHA, swiglu_limit=CLAMP_LIMIT,
                      **twists.ROUTER_LOSS),
        biases="attention_no_mlp", layer_type=twists.global_every(2), layer_types_key=True,
        extra=lambda get: dict(ffn="clamped_swiglu", attn_sinks=True),
        moe=MoEFormat("mlp", "router", ("num_local_experts", "num_experts"), "topk_softmax",
                      fused=("gate_up_proj", "down_proj"), biases=True),
        refuse=(("swiglu_alpha", (CLAMP_ALPHA,), "jaxformer's clamped SwiGLU has alpha 1.702"),
                ("swiglu_limit", (CLAMP_LIMIT,), "jaxformer's clamped SwiGLU clamps at 7"))),
    HFModelType(
        # a bidirectional encoder with the masked-LM head (jaxformer.hf.bert); a bare
        # BertModel has no such head, and is refused
        "bert", ("BertForMaskedLM",), export_rank=24,
        defaults=dict(hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                      layer_norm_eps=1e-12, tie_word_embeddings=True, is_decoder=False,
                      add_cross_attention=False),
        read_config=bert.read_config, write_config=bert.write_config,
        tensor_rules=bert.tensor_rules, tensor_prefix="bert.",
        head_tensor="cls.predictions.decoder.weight", ignored_tensors=bert.BUFFERS,
        arch="encoder"),
    HFModelType(
        # an encoder-decoder (jaxformer.hf.t5): v1.0 (relu, the output scaled by
        # d_model ** -0.5) and v1.1 (gated-gelu, its own head, no scale)
        "t5", ("T5ForConditionalGeneration",), export_rank=25,
        defaults=dict(num_decoder_layers=None, d_kv=64, relative_attention_num_buckets=32,
                      relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
                      feed_forward_proj="relu", is_encoder_decoder=True, is_decoder=False,
                      tie_word_embeddings=True, n_positions=t5.POSITIONS),
        read_config=t5.read_config, write_config=t5.write_config,
        tensor_rules=t5.tensor_rules, tensor_prefix="", ignored_tensors=t5.BUFFERS,
        arch="encoder_decoder"),
    HFModelType(
        # an encoder-decoder (jaxformer.hf.bart): post-LN, learned positions (offset 2) of
        # each stack, a norm on the embeddings, final_logits_bias
        "bart", ("BartForConditionalGeneration",), export_rank=26,
        defaults=dict(max_position_embeddings=1024, activation_function="gelu",
                      scale_embedding=False, is_encoder_decoder=True, is_decoder=False,
                      tie_word_embeddings=True),
        read_config=bart.read_config, write_config=bart.write_config,
        tensor_rules=bart.tensor_rules, ignored_tensors=bart.BUFFERS, arch="encoder_decoder"),
    # the hybrids: recurrent layers beside attention (jaxformer.model.mixers), each family's
    # rows in its layout's module
    *gated_delta_layout.ROWS, *mamba2_layout.ROWS, *nemotron_layout.ROWS, *lfm2_layout.ROWS,
    *falcon_h1_layout.ROWS,
    # 2026's open families, each in its layout's module
    *glm_layout.ROWS, *ernie_layout.ROWS, *seed_oss_layout.ROWS, *hunyuan_layout.ROWS,
    *apertus_layout.ROWS, *minimax_layout.ROWS, *afmoe_layout.ROWS, *llama4_layout.ROWS,
    # multimodal folders: the text model read, the vision tower skipped
    *multimodal.ROWS,
]}

# Model types that are another model (MoE, multimodal, a different block): named when refused.
OTHER_MODEL_TYPES = {
    "gemma3n": "Gemma 3n",
    "olmo": "OLMo 1 (non-parametric LayerNorm)", "cohere": "Cohere 1 (Command-R)",
    "phimoe": "a mixture of experts"}
