"""Attention as functions of arrays: the backends' table and dispatch (backends:
dot_product_attention, BACKENDS), the rules that choose one (rules), the kernels
(chunked, blockwise, splash, ring), masks built from positions and segment ids (masks),
the KV cache (kv_cache) and multi-head latent attention's math (mla). The Flax modules
that declare attention's parameters live in jaxformer.model.

``from jaxformer.attention import dot_product_attention, attention_weights, causal_mask``"""

from jaxformer.attention.backends import dot_product_attention, resolve_impl, rule_attention
from jaxformer.attention.masks import causal_mask, make_attention_mask
from jaxformer.core.reference import attention_weights

__all__ = ["attention_weights", "causal_mask", "dot_product_attention", "make_attention_mask",
           "resolve_impl", "rule_attention"]
