"""Transformer: embed -> blocks (looped or scanned) -> final norm -> LM head.

Also parameter counts and training FLOPs derived from a config, and conversion of the
block params between per-layer (block_0, block_1, ...) and stacked (blocks) form
(jaxformer.model.layer_runs).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.attention import kv_cache
from jaxformer.attention.backends import dense_logits_bytes, resolve_impl, takes_structure
from jaxformer.attention.masks import MaskRule
from jaxformer.core.hooks import hook_point
from jaxformer.core.matmul import flat_dot_general, promote_kernel
from jaxformer.core.sharding import constrain, init_with_names, sequence_split
from jaxformer.model.archs import ARCHS
from jaxformer.model.blocks import Block, apply_norm, make_norm
from jaxformer.model.config import ModelConfig
from jaxformer.model.kinds import BLOCKS, FFNS, REMATS
from jaxformer.model.mixers import MIXERS
from jaxformer.model.mtp import MTPModule, block_config, embedded, shifted
from jaxformer.model.layer_runs import stack_layers, unstack_layers  # noqa: F401 (the public names)
from jaxformer.model.self_attention import dense_init
from jaxformer.positions.schemes import POSITION_SCHEMES, PositionBias, dense_bias

head_dot = functools.partial(flat_dot_general, preferred_element_type=jnp.float32)  # f32 logits


def block_stack(cfg: ModelConfig, deterministic: bool, impl: str):
    """The Block modules as the config wants them run (rematerialised and/or scanned), with
    the attention backend `impl` chosen for this forward: one per layer, or one scan per
    run of alike layers (cfg.layer_runs), each with its Run."""
    block = Block
    remat = REMATS[cfg.remat]
    if remat.on:
        block = nn.remat(block, policy=remat.policy, prevent_cse=not cfg.scan_layers)
    if not cfg.scan_layers:
        return [block(cfg, deterministic, impl=impl, kind=kind, sparse=sparse, mixer=mixer,
                      ffn=ffn, parallel=parallel, name=f"block_{i}")
                for i, (kind, sparse, mixer, ffn, parallel) in enumerate(zip(
                    cfg.layer_kind_ids, cfg.sparse_layers, cfg.layer_mixers, cfg.layer_ffns,
                    cfg.layer_parallels))]
    b = nn.broadcast  # positions, masks, bias, cache, index, kind id, memory, cross, segments
    return [(run, nn.scan(block, variable_axes={"params": 0, "moe": 0},
                          split_rngs={"params": True, "dropout": True},
                          metadata_params={nn.PARTITION_NAME: "layers"},
                          in_axes=(b, b, b, 0, b, 0, b, b, b), length=run.length)
             (cfg, deterministic, scanned=True, impl=impl, sparse=cfg.sparse_layers[run.start],
              mixer=cfg.layer_mixers[run.start], ffn=cfg.layer_ffns[run.start],
              parallel=cfg.layer_parallels[run.start], name=run.name)) for run in cfg.layer_runs]


class Transformer(nn.Module):
    """A language model; logits are float32 [batch, seq, vocab]. A decoder (causal), or
    with cfg.arch=encoder a bidirectional encoder (no causal rule; no KV cache).

    ``positions`` [B, T] default to arange; ``segment_ids`` [B, T] (optional) pack several
    documents in a row (attention stays inside a segment) and mark padding with 0.

    ordered_positions: positions grow along each segment, so masks may read them. False
    for ids that need not (position coupling, Abacus: jaxformer.experiments.tasks): the
    causal mask then goes by index alone, and only whole sequences run (no KV cache, no
    split sequence, no window).
    """

    cfg: ModelConfig
    ordered_positions: bool = True

    @nn.nowrap
    def init(self, *args, **kwargs):
        """As flax's Module.init, returning plain arrays: the params' logical axis names
        are read from the boxed form by ``jaxformer.core.sharding.logical_axes``."""
        return nn.meta.unbox(super().init(*args, **kwargs))

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, deterministic: bool = True,
                 cache=None, *, hidden: bool = False, mtp: bool = False, depth: int = 0,
                 previous=None, last=None):
        """tokens [B, T] -> logits [B, T, V] float32.

        With a KV cache (``jaxformer.attention.kv_cache.init_cache``) the tokens are the next ones of
        each row, at the given positions: their keys/values are written into the cache's
        next T slots (``cache["index"]``), with ``cache["positions"]`` [B, S] recording each
        slot's position (segment id 0 marks a token as padding: never attended to).
        Attention covers every slot, and the result is (logits, updated cache).

        Multi-token prediction (cfg.mtp_depth, jaxformer.model.mtp): ``mtp`` gives (logits,
        each depth's [D, B, T, V]: depth k's at i predict t_{i+k+1}), with ``hidden`` (x, the
        modules' normed outputs [D, B, T, D]); ``hidden`` (logits, x: the last block's output
        before the final norm[, cache]); ``depth`` k runs module k alone on ``previous``
        (h^{k-1}) and the embeddings of ``tokens`` (t_{i+k}): (its logits, h^k[, its cache]).
        """
        c = self.cfg
        b, t, positions, by_index = self.checked_inputs(tokens, positions, cache)
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
                         embedding_init=init_with_names(dense_init(), "vocab", "embed"),
                         name="embed")
        x = None if depth else self.embed_inputs(embed, tokens, positions, deterministic)

        segments = segment_ids  # the recurrent layers' (their state restarts, skips padding)
        k_positions, k_segments, index, layers = positions, segment_ids, None, None
        if cache is not None:  # keys are the cache's slots; padding slots hold EMPTY_SLOT
            index, layers = cache["index"], cache["layers"]
            k_positions = kv_cache.key_positions(cache, positions, segment_ids)
            k_segments = segment_ids = None
        split = sequence_split()  # context parallelism: the order of a row is the caller's
        impl = self.backend(b, t, k_positions.shape[1], split)
        self.check_unordered(cache, split)
        self.check_recurrent(split)
        causal = c.causal  # the arch's rule (an encoder's is none), decided once here
        mask = tuple(MaskRule(positions, k_positions, segment_ids, k_segments, window=k.window,
                              causal=causal and self.ordered_positions, chunk=k.chunk,
                              by_index=by_index and k.chunk is None,
                              is_causal=causal and cache is None and split is None)
                     for k in c.kinds)  # one per layer kind: each block picks its own
        bias = self.position_bias(impl, t, cache, positions, k_positions)
        rest = (positions, mask, bias)
        if depth:  # one MTP module alone, in its own cache
            h, normed, layer = MTPModule(c, deterministic, impl, name=f"mtp_{depth}")(
                previous, embedded(c, embed.embedding, tokens), *rest,
                layers and layers["block_0"], index, segments)
            out = (self.logits(embed, normed, final=False), h)
            return out if cache is None else (*out, kv_cache.advanced(
                cache, {"block_0": layer}, k_positions, t))
        blocks = block_stack(c, deterministic, impl)  # the blocks run the backend chosen here
        x, layers = self.run_blocks(blocks, x, positions, mask, bias, layers, index, segments)
        if cache is not None:
            cache = kv_cache.advanced(cache, layers, k_positions, t)
        if mtp or (c.mtp_depth and cache is None and self.is_initializing()):
            out = self.mtp_outputs(embed, tokens, x, rest, segments, deterministic, impl, hidden)
            return out if mtp else out[0]

        logits = self.logits(embed, x, last=last)
        out = (logits, x) if hidden else (logits,)
        return out + (cache,) if cache is not None else out if hidden else logits

    def checked_inputs(self, tokens, positions, cache):
        """(B, T, positions [B, T], whether masks may go by index): positions default to
        arange after the cache's tokens; a model this class does not build, tokens not
        [B, T] or longer than the position scheme encodes are refused."""
        c = self.cfg
        if ARCHS[c.arch].module != Transformer.__name__:
            raise NotImplementedError(f"model.arch={c.arch} is not built by Transformer; "
                                      "use jaxformer.model_for(cfg)")
        if cache is not None:
            kv_cache.check_generates(c)  # an encoder has no KV cache
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
        return b, t, positions, by_index

    def mtp_outputs(self, embed, tokens, x, rest, segments, deterministic, impl, hidden):
        """The main logits [B, T, V] and the MTP modules' [D, B, T, V] from the last block's
        output x [B, T, D] (each module fed the previous one's h; rest: (positions, mask,
        bias)), in one head call; with hidden the head's inputs instead: x and the modules'
        normed outputs [D, B, T, D] (the head left to the caller: training.chunked_loss)."""
        c, h, normed = self.cfg, x, []
        for k in range(1, c.mtp_depth + 1):
            h, out, _ = MTPModule(c, deterministic, impl, name=f"mtp_{k}")(
                h, embedded(c, embed.embedding, shifted(tokens, k)), *rest, segments=segments)
            normed.append(out)
        if hidden:
            return x, jnp.stack(normed)
        logits = self.logits(embed, x, tuple(normed))
        return logits[0], jnp.stack(logits[1:])

    def run_blocks(self, blocks, x, positions, mask, bias, layers, index, segments=None):
        """x through block_stack's blocks (and each layer's cache in `layers`, if any)."""
        c = self.cfg
        if c.scan_layers:  # the layer kinds travel as data: each layer's kind id
            for run, scanned in blocks:
                kind_ids = jnp.asarray(c.layer_kind_ids[run.start:run.stop], jnp.int32) \
                    if len(c.kinds) > 1 else None
                x, stacked = scanned(x, positions, mask, bias, layers and layers[run.name],
                                     index, kind_ids, None, None, segments)
                layers = layers and {**layers, run.name: stacked}
            return x, layers
        for block in blocks:
            if layers is None:
                x = block(x, positions, mask, bias, segments=segments)
            else:
                x, layer = block(x, positions, mask, bias, layers[block.name], index,
                                 segments=segments)
                layers = {**layers, block.name: layer}
        return x, layers

    def check_recurrent(self, split):
        """A sequence split over the context axis is refused with recurrent layers."""
        c = self.cfg
        if split is None or not c.recurrent:
            return
        mixers = {m for m in c.layer_mixers + c.layer_parallels if m and MIXERS[m].recurrent}
        raise ValueError(f"a sequence split over the context axis with recurrent layers "
                         f"({', '.join(sorted(mixers))}): their state runs left to right; "
                         "use mesh.context=1")

    def check_unordered(self, cache, split):
        """Positions out of row order mask by index: refused where that cannot hold."""
        windows = {k.window for k in self.cfg.kinds} - {None}
        if not self.ordered_positions and (cache is not None or split is not None or windows):
            raise ValueError("ordered_positions=False masks by index within whole sequences: "
                             "not with a KV cache, a split sequence or a sliding window")

    def backend(self, b: int, t: int, s: int, split) -> str:
        """The attention backend of this forward, chosen once for every layer (`auto`: by
        platform, scheme, the logits' size, soft-cap, windows as data, a split sequence)."""
        c = self.cfg
        return resolve_impl(
            c.attention_impl, c.dtype, c.head_dim, position=c.position,
            logits_bytes=dense_logits_bytes(b, c.n_heads, t, s),
            softcap=c.attn_softcap is not None, sinks=c.attn_sinks, value_width=c.mla.on,
            window_as_data=c.scan_layers and len({k.window for k in c.kinds}) > 1,
            context=1 if split is None else split[0].shape[split[1]],
            kv_bytes=2 * b * s * c.n_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize)

    def position_bias(self, impl: str, t: int, cache, positions, k_positions):
        """The scheme's bias as a LogitBias where the backend reads it a block at a time (or
        a ring in the cache, or a paged step's pairs, recompute it over their own keys),
        else once as an array [B|1, N, T, S] for every layer; None without a bias scheme."""
        bias = PositionBias(self.cfg, name="position_bias")()  # a LogitBias, or None
        if takes_structure(impl, t, cached=cache is not None) or kv_cache.keys_own_positions(
                cache):
            return bias
        return dense_bias(bias, positions, k_positions)

    def embed_inputs(self, embed, tokens, positions, deterministic: bool):
        """Token embeddings [B, T, D], with absolute positions added if the scheme has them."""
        c = self.cfg
        # the lookup reads the table gathered over fsdp (vocab stays split over tensor)
        x = jnp.take(constrain(embed.embedding, "vocab", "act_embed"), tokens, axis=0)
        x = x.astype(c.dtype)
        if c.embed_multiplier != 1.0:  # in the compute dtype, as Gemma's sqrt(d_model)
            x = x * jnp.asarray(c.embed_multiplier, c.dtype)
        x = hook_point(self, "hook_embed", x)
        embed_positions = POSITION_SCHEMES[c.position].embed
        if embed_positions is not None:  # an absolute scheme: terms added to the input
            x, terms = embed_positions(self, c, x, positions)
            x = x + hook_point(self, "hook_pos_embed", terms)
        if c.embed_norm:  # BERT's LayerNorm on the embeddings
            x = apply_norm(c, make_norm(c, "embed_norm"), x)
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        return constrain(x, "act_batch", "act_seq", "act_embed")

    def logits(self, embed, x, more=(), final: bool = True, last=None):
        """The final norm (all but post-LN blocks; not with final=False), the LM head (tied to
        `embed` or not), its multiplier and soft-cap: float32 logits. more: hidden states
        already normed (the MTP modules') through the same head, in one call: then a list
        of logits, x's first. last [B] (__call__'s): the head at token last[b] of each row
        alone, logits [B, 1, V]."""
        c = self.cfg
        if last is not None:  # one token's hidden state per row through the head
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
        if final and not BLOCKS[c.block].ends_in_norm:  # post-LN blocks already end in a norm
            x = apply_norm(c, make_norm(c, "final_norm"), x)
        if more:
            x = jnp.concatenate([x, *more], axis=0)  # [(1 + D) B, T, D]
        if c.head_transform:  # BERT's MLM head: dense, the FFN's activation, a norm
            x = nn.Dense(c.d_model, use_bias=c.use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                         kernel_init=init_with_names(dense_init(), "embed", "norm"),
                         bias_init=init_with_names(nn.initializers.zeros, "norm"),
                         name="head_transform")(x)
            x = apply_norm(c, make_norm(c, "head_norm"), FFNS[c.ffn].activation(x))
        if c.tie_embeddings:
            logits = head_dot(x, embed.embedding.astype(c.dtype),
                              (((2,), (1,)), ((), ())))  # [B, T, D] x [V, D]
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype,
                              param_dtype=c.param_dtype, dot_general=head_dot,
                              promote_dtype=promote_kernel,
                              kernel_init=init_with_names(dense_init(), "embed", "vocab"),
                              name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        if c.head_bias:
            logits = logits + self.param("head_bias", init_with_names(
                nn.initializers.zeros, "vocab"), (c.vocab_size,), c.param_dtype).astype(jnp.float32)
        if c.logits_multiplier != 1.0:
            logits = logits * jnp.float32(c.logits_multiplier)
        if c.final_softcap is not None:
            logits = c.final_softcap * jnp.tanh(logits / c.final_softcap)
        logits = constrain(logits, "act_batch", "act_seq", "act_vocab")
        return jnp.split(logits, 1 + len(more), axis=0) if more else logits


# ---- FLOPs ----------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU.

    6 * N_matmul + 6 * n_layers * n_heads * head_dim * context, where

    - N_matmul counts the weights multiplied per token: every block kernel (of a mixture of
      experts the router, the top_k experts a token reaches and the shared ones) plus the LM head
      (vocab x d_model, tied or not). The embedding lookup is a gather (no FLOPs); norms and
      biases are negligible and not counted. Each weight costs 2 FLOPs forward, 4 backward.
    - attention scores (q.k) and the weighted sum (a.v) cost 2 * 2 * n_heads * head_dim per
      query-key pair forward, x3 with backward = 12 * n_heads * head_dim, times the
      context: the mean number of keys a query sees, seq_len / 2 under the causal rule
      (blocks above the diagonal skipped or not, the useful half), seq_len in an encoder.
      With a sliding window w < seq_len, w - w^2 / (2 seq_len) causal, twice that in an
      encoder (|i - j| < w); with a layer pattern, each layer's own. MLA (expanded, as
      it trains): its projections' weights, and n_heads * (qk + v head dims) / 2 in place of
      n_heads * head_dim.
    - a hybrid: attention's counts in the attention layers alone, the FFN's in the layers
      that have one, and each recurrent layer's its mixer's (jaxformer.model.mixers: its
      projections' weights and its recurrence in the chunked form, linear in seq_len).
      Gated attention (attn_output_gate) adds its gate's projection.
    - an encoder-decoder (its source and target rows both seq_len, as data.seq2seq packs
      them; per target token): the encoder stack's count without a head, the decoder's
      (causal), and in each decoder layer the cross-attention's four projections (keys and
      values of as many source tokens as target ones) and seq_len keys per query.
    - multi-token prediction (model.mtp_depth): its modules' count, mtp_flops.
    """
    c, m = cfg, cfg.mla
    attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads + c.attn_output_gate
                                     * c.n_heads)
    if ARCHS[c.arch].cross_attention:
        encoder = flops_per_token(c.stack(ARCHS[c.arch].encoder), seq_len) - \
            6.0 * c.d_model * c.vocab_size
        decoder = flops_per_token(c.stack("decoder"), seq_len)
        return encoder + decoder + c.n_layers * (6.0 * attn + 12.0 * c.n_heads * c.head_dim
                                                 * seq_len)
    pair = c.n_heads * c.head_dim  # the attention's FLOPs per query-key pair, / 4
    if m.on:
        query = (c.d_model + c.n_heads * m.qk_head_dim) * m.q_lora_rank if m.q_lora_rank \
            else c.d_model * c.n_heads * m.qk_head_dim
        attn = query + c.d_model * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * \
            c.n_heads * (m.qk_nope_head_dim + m.v_head_dim) + c.n_heads * m.v_head_dim * c.d_model
        pair = c.n_heads * (m.qk_head_dim + m.v_head_dim) / 2
    mult = 3 if c.gated_ffn else 2
    dense_ffn = mult * c.d_model * c.d_ff
    sparse_ffn = (c.d_model * c.moe.experts  # the router, then the active experts
                  + mult * c.d_model * (c.moe.top_k * c.expert_d_ff + c.shared_d_ff)
                  + c.d_model * c.moe.shared_gate)
    ffn = sum((sparse_ffn if s else dense_ffn) * f for s, f in zip(c.sparse_layers, c.layer_ffns))
    attends = [MIXERS[x].mixes and not MIXERS[x].recurrent for x in c.layer_mixers]
    n_matmul = sum(attends) * attn + ffn + c.d_model * c.vocab_size
    recurrent = sum(MIXERS[x].flops(c, c.mixer_settings(x), seq_len) for x in
                    c.layer_mixers + c.layer_parallels if x and MIXERS[x].recurrent)

    def context(w):
        half = seq_len / 2 if w is None or w >= seq_len else w - w * w / (2 * seq_len)
        return half if c.causal else 2 * half  # an encoder's query sees both sides

    keys = sum(context(c.kinds[i].window) for i, a in zip(c.layer_kind_ids, attends) if a)
    return 6.0 * n_matmul + 12.0 * pair * keys + recurrent + mtp_flops(c, seq_len)


def mtp_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the model.mtp_depth modules (jaxformer.model.mtp; 0
    without), each on every token: its eh_proj (2 d_model x d_model) and a one-layer
    model of its block (the last layer's kind, its attention's keys included) whose LM head
    (d_model x vocab, the model's) is multiplied again."""
    if not cfg.mtp_depth:
        return 0.0
    module = flops_per_token(block_config(cfg).replace(mtp_depth=0), seq_len)
    return cfg.mtp_depth * (module + 12.0 * cfg.d_model * cfg.d_model)
