"""Transformer: embed -> blocks (looped or scanned) -> final norm -> LM head.

Also parameter counts and training FLOPs derived from a config, and conversion of the
block params between per-layer (block_0, block_1, ...) and stacked (blocks) form.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import kv_cache
from jaxformer.attention import dense_init
from jaxformer.backends import dense_logits_bytes, resolve_impl, takes_structure
from jaxformer.config import ModelConfig
from jaxformer.hooks import hook_point
from jaxformer.layers import Block, apply_norm, make_norm
from jaxformer.masks import MaskRule
from jaxformer.matmul import flat_dot_general
from jaxformer.schemes import POSITION_SCHEMES, PositionBias, dense_bias
from jaxformer.sharding import constrain, init_with_names

head_dot = functools.partial(flat_dot_general, preferred_element_type=jnp.float32)  # f32 logits

REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute it all in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def block_stack(cfg: ModelConfig, deterministic: bool, impl: str):
    """The Block class as the config wants it run (rematerialised and/or scanned), with
    the attention backend `impl` chosen for this forward."""
    block = Block
    if cfg.remat != "none":
        block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if not cfg.scan_layers:
        return [block(cfg, deterministic, impl=impl, name=f"block_{i}")
                for i in range(cfg.n_layers)]
    scanned = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True,
                      "dropout": True}, metadata_params={nn.PARTITION_NAME: "layers"},
                      in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, nn.broadcast),
                      length=cfg.n_layers)  # positions, mask, bias, cache (per layer), index
    return scanned(cfg, deterministic, scanned=True, impl=impl, name="blocks")


class Transformer(nn.Module):
    """A decoder-only language model; logits are float32 [batch, seq, vocab].

    ``positions`` [B, T] default to arange; ``segment_ids`` [B, T] (optional) pack several
    documents in a row (attention stays inside a segment) and mark padding with 0.
    """

    cfg: ModelConfig

    @nn.nowrap
    def init(self, *args, **kwargs):
        """As flax's Module.init, returning plain arrays: the params' logical axis names
        are read from the boxed form by ``jaxformer.sharding.logical_axes``."""
        return nn.meta.unbox(super().init(*args, **kwargs))

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, deterministic: bool = True,
                 cache=None):
        """tokens [B, T] -> logits [B, T, V] float32.

        With a KV cache (``jaxformer.kv_cache.init_cache``) the tokens are the next ones of
        each row, at the given positions: their keys/values are written into the cache's
        next T slots (``cache["index"]``), with ``cache["positions"]`` [B, S] recording each
        slot's position (segment id 0 marks a token as padding: never attended to).
        Attention covers every slot, and the result is (logits, updated cache).
        """
        c = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
        b, t = tokens.shape
        by_index = positions is None and cache is None  # arange: masks by index (MaskRule)
        if positions is None:  # with a cache: the tokens after those already in it
            start = 0 if cache is None else cache["index"]
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        longest = POSITION_SCHEMES[c.position].max_length
        if longest is not None and t > longest(c):
            raise ValueError(f"sequence length {t} exceeds max_seq_len={c.max_seq_len}, the "
                             f"longest position={c.position!r} encodes (its table's size); use "
                             "a shorter input or another position scheme")

        embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
                         embedding_init=init_with_names(dense_init(), "vocab", "embed"),
                         name="embed")
        x = self.embed_inputs(embed, tokens, positions, deterministic)  # [B, T, D]

        k_positions, k_segments, index, layers = positions, segment_ids, None, None
        if cache is not None:  # keys are the cache's slots; padding slots hold EMPTY_SLOT
            index, layers = cache["index"], cache["layers"]
            k_positions = kv_cache.key_positions(cache, positions, segment_ids)
            k_segments = segment_ids = None
        bias = PositionBias(c, name="position_bias")()  # a LogitBias, or None
        impl = resolve_impl(c.attention_impl, c.dtype, c.head_dim, position=c.position,
                            logits_bytes=dense_logits_bytes(b, c.n_heads, t, k_positions.shape[1]))
        mask = MaskRule(positions, k_positions, segment_ids, k_segments, window=c.sliding_window,
                        is_causal=cache is None, by_index=by_index)
        if not takes_structure(impl, t, cached=cache is not None):  # once, for every layer
            bias = dense_bias(bias, positions, k_positions)  # [B|1, N, T, S]
        blocks = block_stack(c, deterministic, impl)  # the blocks run the backend chosen here
        if c.scan_layers:
            x, stacked = blocks(x, positions, mask, bias, layers and layers["blocks"], index)
            layers = layers and {"blocks": stacked}
        else:
            for block in blocks:
                if layers is None:
                    x = block(x, positions, mask, bias)
                else:
                    x, layer = block(x, positions, mask, bias, layers[block.name], index)
                    layers = {**layers, block.name: layer}
        if cache is not None:
            cache = kv_cache.advanced(cache, layers, k_positions, t)

        logits = self.logits(embed, x)
        return logits if cache is None else (logits, cache)

    def embed_inputs(self, embed, tokens, positions, deterministic: bool):
        """Token embeddings [B, T, D], with absolute positions added if the scheme has them."""
        c = self.cfg
        # the lookup reads the table gathered over fsdp (vocab stays split over tensor)
        x = jnp.take(constrain(embed.embedding, "vocab", "act_embed"), tokens, axis=0)
        x = hook_point(self, "hook_embed", x.astype(c.dtype))
        embed_positions = POSITION_SCHEMES[c.position].embed
        if embed_positions is not None:  # an absolute scheme: terms added to the input
            x, terms = embed_positions(self, c, x, positions)
            x = x + hook_point(self, "hook_pos_embed", terms)
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        return constrain(x, "act_batch", "act_seq", "act_embed")

    def logits(self, embed, x):
        """The final norm (pre-LN) and the LM head (tied to `embed` or not): float32 logits."""
        c = self.cfg
        if c.block == "pre_ln":  # post-LN blocks already end in a norm
            x = apply_norm(c, make_norm(c, "final_norm"), x)
        if c.tie_embeddings:
            logits = head_dot(x, embed.embedding.astype(c.dtype),
                              (((2,), (1,)), ((), ())))  # [B, T, D] x [V, D]
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype,
                              param_dtype=c.param_dtype, dot_general=head_dot,
                              kernel_init=init_with_names(dense_init(), "embed", "vocab"),
                              name="lm_head")(x)
        return constrain(logits.astype(jnp.float32), "act_batch", "act_seq", "act_vocab")


# ---- params: counting and reshaping ------------------------------------------------


def param_shapes(cfg: ModelConfig):
    """The param tree as jax.ShapeDtypeStructs, via jax.eval_shape (allocates nothing)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)
    return variables["params"]


def count_params(cfg: ModelConfig) -> int:
    """Exact number of parameters, without allocating them."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(param_shapes(cfg))))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU.

    6 * N_matmul + 6 * n_layers * n_heads * head_dim * context, where

    - N_matmul counts the weights multiplied per token: every block kernel plus the LM head
      (vocab x d_model, tied or not). The embedding lookup is a gather (no FLOPs); norms and
      biases are negligible and not counted. Each weight costs 2 FLOPs forward, 4 backward.
    - attention scores (q.k) and the weighted sum (a.v) cost 2 * 2 * n_heads * head_dim per
      query-key pair forward, x3 with backward = 12 * n_heads * head_dim. Causal attention
      is counted once at half: context = seq_len / 2 keys per query (no FLOPs for the masked
      half). With a sliding window w < seq_len, context = w - w^2 / (2 seq_len), the mean
      number of keys a query sees.
    """
    c = cfg
    attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    ffn = (3 if c.gated_ffn else 2) * c.d_model * c.d_ff
    n_matmul = c.n_layers * (attn + ffn) + c.d_model * c.vocab_size
    w = c.sliding_window
    context = seq_len / 2 if w is None or w >= seq_len else w - w * w / (2 * seq_len)
    return 6.0 * n_matmul + 12.0 * c.n_layers * c.n_heads * c.head_dim * context


def stack_layers(params, n_layers: int):
    """Per-layer params {block_0, ..., block_{L-1}} -> stacked {blocks: [L, ...]} (for scan)."""
    params = dict(params)
    missing = [f"block_{i}" for i in range(n_layers) if f"block_{i}" not in params]
    if missing:
        raise KeyError(f"stack_layers needs per-layer params; {', '.join(missing)} missing "
                       f"(found {', '.join(sorted(params))})")
    layers = [params.pop(f"block_{i}") for i in range(n_layers)]
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


def unstack_layers(params):
    """Stacked {blocks: [L, ...]} -> per-layer {block_0, ..., block_{L-1}}."""
    params = dict(params)
    if "blocks" not in params:
        raise KeyError(f"unstack_layers needs stacked params under 'blocks' "
                       f"(found {', '.join(sorted(params))})")
    stacked = params.pop("blocks")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n_layers):
        params[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params
