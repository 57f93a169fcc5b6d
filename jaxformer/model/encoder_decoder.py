"""The encoder-decoder (model.arch=encoder_decoder): "Attention Is All You Need"'s model,
T5's and BART's shape, from the decoder's blocks.

The encoder: `encoder_layers` Blocks whose self-attention has no causal rule (padding and
packing masks as in the decoder), then the final norm. The decoder: `n_layers` causal
Blocks, each with cross-attention over the encoder's output (jaxformer.model.cross_attention)
after its self-attention, then the final norm and the LM head. Self-attention takes the
position scheme as the decoder-only model does, in each stack with params of its own (a
learned table, a bias scheme's params); cross-attention takes none. tie_embeddings: one
table for the source, the target and the output; else three, or two with
tie_source_embed (the source reads the target's table; the head is its own: T5 v1.1's).
With scan_layers each stack scans its layers as the decoder-only model does (params and
cache under encoder/blocks and decoder/blocks: jaxformer.model.layer_runs), so its program's
size does not grow with depth.

    logits = model.apply({"params": p}, source_tokens, target_tokens,
                         source_segment_ids=..., target_segment_ids=...,
                         source_positions=..., target_positions=...)
    memory = model.apply(v, source_tokens, source_segment_ids, method="encode")
    logits = model.apply(v, target_tokens, memory, method="decode")          # or
    logits, cache = model.apply(v, tokens, memory, positions, cache=cache, method="decode")

The cache is jaxformer.attention.kv_cache's for the decoder (init_cache(cfg, ...)); its first call
also stores each layer's cross-attention keys and values (cross_k, cross_v), read after.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.attention import kv_cache
from jaxformer.attention.masks import MaskRule
from jaxformer.core.sharding import init_with_names
from jaxformer.model.archs import ARCHS
from jaxformer.model.blocks import Block, apply_norm, make_norm
from jaxformer.model.cross_attention import Memory
from jaxformer.model.kinds import BLOCKS, REMATS
from jaxformer.model.self_attention import dense_init
from jaxformer.model.transformer import Transformer


def arange_like(tokens, start=0):
    """Positions start, start + 1, ... for each row of tokens [B, T]."""
    b, t = tokens.shape
    return jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))


def stack_blocks(cfg, deterministic: bool, impl: str, cross: bool):
    """A stack's Blocks as the config runs them (rematerialised and/or scanned), each with
    its params' name: one per layer (block_i), or with scan_layers one nn.scan per run of
    alike layers (cfg.layer_runs: blocks, or blocks_0, blocks_1, ...) over the layers'
    params and caches, the rest (positions, masks, bias, the memory and its mask)
    broadcast to every layer. No layer kind is passed: every layer runs the first, as in
    the per-layer loop."""
    remat = REMATS[cfg.remat]
    block = nn.remat(Block, policy=remat.policy, prevent_cse=not cfg.scan_layers) \
        if remat.on else Block
    if not cfg.scan_layers:
        return [(f"block_{i}", block(cfg, deterministic, impl=impl, sparse=sparse, cross=cross,
                                     name=f"block_{i}"))
                for i, sparse in enumerate(cfg.sparse_layers)]
    axes = (nn.broadcast,) * 3 + (0, nn.broadcast, 0, nn.broadcast, nn.broadcast)
    return [(run.name, nn.scan(block, variable_axes={"params": 0, "moe": 0},
                               split_rngs={"params": True, "dropout": True},
                               metadata_params={nn.PARTITION_NAME: "layers"},
                               in_axes=axes,  # positions, mask, bias, cache, index, kind id,
                               length=run.length)  # memory, cross mask
             (cfg, deterministic, scanned=True, impl=impl, sparse=cfg.sparse_layers[run.start],
              cross=cross, name=run.name)) for run in cfg.layer_runs]


def layer_stacks(cfg):
    """Each stack of layers in a model's params: (its path's prefix, the config whose
    layer_runs it scans); an encoder-decoder's encoder/ and decoder/, another model's
    top level."""
    encoder = ARCHS[cfg.arch].encoder
    if encoder is None:
        return (((), cfg),)
    return ((("encoder",), cfg.stack(encoder)), (("decoder",), cfg))


class Stack(Transformer):
    """One stack of an encoder-decoder: embedding (and absolute positions), Blocks and, for
    the decoder (cross), the final norm and LM head; for the encoder the final norm.
    Reuses the decoder-only Transformer's embedding, backend choice, position bias and
    head. embed: the token table it reads (shared per tie_embeddings)."""

    embed: nn.Module | None = None
    cross: bool = False

    @nn.compact
    def __call__(self, tokens, positions, segment_ids, deterministic=True, memory=None,
                 cache=None, hidden: bool = False):
        c = self.cfg
        b, t = tokens.shape
        x = self.embed_inputs(self.embed, tokens, positions, deterministic)  # [B, T, D]
        k_positions, k_segments, index, layers = positions, segment_ids, None, None
        cross_rule = None if memory is None else memory.rule(positions, segment_ids)
        if cache is not None:  # keys are the cache's slots (as the decoder-only model's)
            index, layers = cache["index"], cache["layers"]
            k_positions = kv_cache.key_positions(cache, positions, segment_ids)
            k_segments = segment_ids = None
        impl = self.backend(b, t, k_positions.shape[1], None)
        mask = MaskRule(positions, k_positions, segment_ids, k_segments, causal=c.causal,
                        is_causal=c.causal and cache is None)
        bias = self.position_bias(impl, t, cache, positions, k_positions)
        for name, layer in stack_blocks(c, deterministic, impl, self.cross):
            if layers is None:
                x = layer(x, positions, mask, bias, None, None, None, memory, cross_rule)
                x = x[0] if c.scan_layers else x  # a scan's (carry, per-layer None)
            else:
                x, new = layer(x, positions, mask, bias, layers[name], index, None, memory,
                               cross_rule)
                layers = {**layers, name: new}
        if cache is not None:
            cache = kv_cache.advanced(cache, layers, k_positions, t)
        if not self.cross:
            return x if BLOCKS[c.block].ends_in_norm else \
                apply_norm(c, make_norm(c, "final_norm"), x)
        out = (self.logits(self.embed, x),) + ((x,) if hidden else ())  # x: the head's input
        out += (cache,) if cache is not None else ()  # as Transformer's
        return out if len(out) > 1 else out[0]


class EncoderDecoder(nn.Module):
    """model.arch=encoder_decoder (see the module's docstring); logits float32 [B, T, V]."""

    cfg: object  # a ModelConfig

    @nn.nowrap
    def init(self, *args, **kwargs):
        """As Transformer.init: plain arrays (logical axis names read from the boxed form)."""
        return nn.meta.unbox(super().init(*args, **kwargs))

    def setup(self):
        c = self.cfg
        table = lambda: nn.Embed(  # noqa: E731
            c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
            embedding_init=init_with_names(dense_init(), "vocab", "embed"))
        self.embed = table()
        source = self.embed
        if not (c.tie_embeddings or c.tie_source_embed):
            self.source_embed = source = table()
        # the encoder stack is an encoder (no causal rule; T5's bidirectional buckets)
        self.encoder = Stack(c.stack(ARCHS[c.arch].encoder), embed=source)
        self.decoder = Stack(c, embed=self.embed, cross=True)

    def __call__(self, source_tokens, target_tokens=None, source_segment_ids=None,
                 target_segment_ids=None, source_positions=None, target_positions=None,
                 deterministic: bool = True, hidden: bool = False):
        """source [B, S], target [B, T] tokens -> the target's logits [B, T, V] float32;
        with hidden (logits, x: the decoder's last block output before the final norm, the
        head's input, as Transformer's hidden). Segment ids (0 = padding) pack several
        pairs in a row, segment s of the target attending to segment s of the source;
        positions default to arange. target_tokens None: the source again (an init given
        one example input, as Transformer's)."""
        target_tokens = source_tokens if target_tokens is None else target_tokens
        memory = self.encode(source_tokens, source_segment_ids, source_positions, deterministic)
        return self.decode(target_tokens, memory, target_positions, target_segment_ids,
                           deterministic, hidden=hidden)

    def encode(self, tokens, segment_ids=None, positions=None, deterministic: bool = True):
        """The source [B, S] through the encoder -> Memory (states [B, S, D], positions,
        segment ids: all 1 when None)."""
        positions = arange_like(tokens) if positions is None else positions
        states = self.encoder(tokens, positions, segment_ids, deterministic)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        return Memory(states, positions, segment_ids)

    def decode(self, tokens, memory: Memory, positions=None, segment_ids=None,
               deterministic: bool = True, cache=None, hidden: bool = False):
        """The target [B, T] through the decoder over `memory` -> logits [B, T, V], or
        (logits, cache) with a KV cache (positions default to the slots after those in it);
        with hidden the head's input x [B, T, D] after the logits: (logits, x[, cache])."""
        if positions is None:
            positions = arange_like(tokens, 0 if cache is None else cache["index"])
        return self.decoder(tokens, positions, segment_ids, deterministic, memory, cache,
                            hidden)

