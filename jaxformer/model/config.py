"""ModelConfig: the one switchboard of the model, validated when it is built."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxformer.attention.backends import AUTO, BACKENDS, check_model
from jaxformer.attention.mla import MLAConfig
from jaxformer.core.low_precision import MATMUL_PRECISIONS
from jaxformer.core.validation import (ConfigError, Section, as_section,  # noqa: F401
                                       check_choice, check_number, coerce, type_names)
from jaxformer.model.archs import ARCHS
from jaxformer.model.kinds import BLOCKS, FFNS, NORMS, QK_NORMS, REMATS
from jaxformer.model.layer_pattern import (LayerKind, check_layer_forms, check_mixers,
                                           check_pattern, layer_forms, layer_parallels, read_pattern)
from jaxformer.model.layer_runs import Run, runs
from jaxformer.model.lora import LoRAConfig, check_expert_targets
from jaxformer.model.mixers import MIXER_RUNTIME, MIXERS, read_mixer_settings, settings_of
from jaxformer.model.presets import PRESETS, preset_values  # noqa: F401 (PRESETS: public)
from jaxformer.moe.experts import MoEConfig
from jaxformer.positions.rope_scaling import RopeScaling
from jaxformer.positions.schemes import (LEGACY_KEYS, POSITION_SCHEMES, check_position,
                                         read_settings, schemes_of)

DTYPES = ("float32", "bfloat16", "float16")
# the fields that change how a model runs, not what it computes (a mixer's: mixer.NAME.KEY)
# a converted or initialised-from model may set freely; no saved state depends on
# COMPUTE_ONLY's (unlike param_dtype, scan_layers): a checkpoint restores under any value
COMPUTE_ONLY = ("dtype", "matmul_precision", "remat", "attention_impl", "dropout") + MIXER_RUNTIME
RUNTIME = COMPUTE_ONLY + ("param_dtype", "scan_layers")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Every architectural choice of a transformer. arch (jaxformer.model.archs.ARCHS):
    decoder, encoder (no causal rule: padding and packing masks as ever, a window symmetric;
    no generation), encoder_decoder.

    None fields are resolved at construction: n_kv_heads -> n_heads, qkv_bias -> use_bias,
    head_dim -> d_model // n_heads, d_ff -> 4 * d_model (gelu/relu) or
    8/3 * d_model rounded up to a multiple of 64 (swiglu/geglu).

    position (jaxformer.positions.schemes.POSITION_SCHEMES): rope, alibi, t5 (T5's learned
    bias per head and relative-position bucket), fire (Li et al. 2023's MLP of the
    normalised log distance), sinusoidal, learned (a table of max_seq_len rows), none
    (NoPE), and the length-generalisation schemes xpos (Sun et al. 2022), kerple (Chi et
    al. 2022, log), sandwich (Chi et al. 2023), cope (Golovneva et al. 2024). The bias
    schemes' biases are computed once per forward and shared by every layer.
    position_settings: the scheme's own hyperparameters, an instance of its entry's
    settings class (a mapping of its fields in YAML; None: its defaults): t5's
    num_buckets and max_distance, sinusoidal's scale, cope's positions.
    t5_num_buckets, t5_max_distance, sinusoidal_scale, cope_positions: the flat keys of
    earlier versions, read into position_settings (None once built; LEGACY_KEYS): the
    chosen scheme's own become its settings, another's is accepted at its default only.
    The RoPE fields (rope_theta, rope_scaling, rope_fraction, p_rope) stay model fields:
    rope and xpos share them, layer kinds override them, MLA's rope key reads them.
    rope_fraction: the share of each head's dimensions RoPE rotates (GPT-NeoX's rotary_pct,
    HF's partial_rotary_factor): the first head_dim * rope_fraction, paired half with
    half among themselves, with frequencies over those dimensions; the rest pass through.
    p_rope: p-RoPE's p (Barbero et al. 2024): the share of the rotated pairs' frequencies
    kept, the highest; the lowest ones are set to 0 (those pairs pass through unrotated).
    1 is RoPE, 0 NoPE. With rope_fraction < 1, a share of the frequencies of the rotated
    dimensions.

    norm: layernorm, rmsnorm, or rmsnorm_offset (x / rms(x) * (1 + scale), the scale
    initialised at 0: Gemma). block (jaxformer.model.kinds.BLOCKS): pre_ln, post_ln,
    sandwich (a norm before and after each sublayer, inside the residual: Gemma 2/3),
    res_post_ln (a norm after each sublayer only, inside the residual: OLMo 2), parallel
    (x + attn(norm1 x) + ffn(norm2 x): GPT-NeoX), parallel_shared_ln (one norm for both:
    Cohere, GPT-J). qk_norm: the model's norm on queries and keys before RoPE, per head
    over head_dim (head: Qwen3, Gemma 3) or over the whole projection (projection: OLMo 2);
    head_after_rope: per head on the rotated queries and keys (Hunyuan).

    attn_scale: the logits' scale (None: 1 / sqrt(head_dim)). attn_softcap, final_softcap:
    cap * tanh(x / cap) on the scaled attention logits (before any position bias and the
    mask) and on the output logits (Gemma 2). attn_sinks: a learned logit per query head
    (param attn/sinks [N]) in every row's softmax, a key with a zero value (gpt-oss).
    attn_output_gate: each head's output times sigmoid of a gate projected from the input
    (param attn/gate [D, N, H]; Qwen3-Next's and Qwen3.5's gated attention).
    embed_multiplier (Gemma: sqrt(d_model),
    rounded to the compute dtype; Granite), residual_multiplier (each sublayer's output
    before it joins the residual: Granite), logits_multiplier (Cohere's logit_scale,
    Granite's 1 / logits_scaling).

    embed_norm: the model's norm on the input embeddings (positions added): BERT.
    head_transform: before the LM head, a dense d_model -> d_model, the FFN's activation and
    the model's norm (BERT's MLM head transform); head_bias: a bias [vocab] on the logits.

    matmul_precision: jaxformer.core.low_precision's table (default, bf16, fp8, int8, ...).
    lora (jaxformer.model.lora.LoRAConfig): low-rank adapters on the projections; rank 0: none.
    moe (jaxformer.moe.experts.MoEConfig): mixture-of-experts feed-forward layers; experts 0: none.
    mla (jaxformer.attention.mla.MLAConfig): multi-head latent attention; kv_lora_rank 0: none.

    layer_pattern, layer_kinds: a list of kind names repeated over the layers (layer i is
    layer_pattern[i % len]), each a LayerKind in layer_kinds (its window, its RoPE or
    none): Gemma 3's five local layers to one global. Empty: every layer alike, with
    sliding_window.
    mixer: the recurrent mixers' settings, {name: its settings or a mapping of them}
    (jaxformer.model.mixers: model.mixer.gated_delta.heads=8); a layer kind names its
    mixer (model.layer_kinds.<kind>.mixer), attention by default.
    """

    arch: str = "decoder"
    encoder_layers: int | None = None  # arch=encoder_decoder: the encoder's (None: n_layers)
    tie_source_embed: bool = False  # encoder_decoder, untied head: one table in (T5 v1.1)
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 256
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    position_settings: Any = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    block: str = "pre_ln"
    ffn: str = "gelu"
    use_bias: bool = True
    qkv_bias: bool | None = None  # biases on query/key/value only (Qwen2); None = use_bias
    tie_embeddings: bool = True
    dropout: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    matmul_precision: str = "default"  # the projections' dots (core.low_precision's table)
    scan_layers: bool = False
    remat: str = "none"
    sliding_window: int | None = None
    attention_impl: str = "auto"
    rope_fraction: float = 1.0
    p_rope: float = 1.0
    qk_norm: str = "none"
    attn_scale: float | None = None
    attn_softcap: float | None = None
    attn_sinks: bool = False
    attn_output_gate: bool = False
    final_softcap: float | None = None
    embed_norm: bool = False
    head_transform: bool = False
    head_bias: bool = False
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    layer_pattern: tuple[str, ...] = ()
    layer_kinds: Mapping[str, LayerKind] = dataclasses.field(default_factory=dict)
    lora: LoRAConfig = LoRAConfig()
    moe: MoEConfig = MoEConfig()
    mla: MLAConfig = MLAConfig()
    mixer: Any = None
    mtp_depth: int = 0  # multi-token prediction modules (jaxformer.model.mtp; at most 8)
    # earlier versions' flat keys of the schemes' settings (LEGACY_KEYS): None once built
    t5_num_buckets: int | None = None
    t5_max_distance: int | None = None
    sinusoidal_scale: str | None = None
    cope_positions: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name, section in (("lora", LoRAConfig), ("moe", MoEConfig), ("mla", MLAConfig)):
            set_(name, as_section(section, getattr(self, name), f"model.{name}"))
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        elif isinstance(self.rope_scaling, str):
            set_("rope_scaling", RopeScaling(kind=self.rope_scaling))
        elif not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} must be a RopeScaling, "
                              "a mapping of its fields, or a kind name")
        if self.qkv_bias is None:
            set_("qkv_bias", self.use_bias)
        self._read_pattern(set_)
        set_("mixer", read_mixer_settings(self.mixer))
        self._check_fields()
        self._read_position_settings(set_)
        self._resolve_sizes(set_)
        self._check_together(set_)
        absent = ("wi",) if self.gated_ffn else ("wi_gate", "wi_up")
        if set(absent) & set(self.lora.targets):
            raise ConfigError(f"model.lora.targets names {', '.join(absent)}, which a model with "
                              f"ffn={self.ffn} does not have; its MLP projections are "
                              f"{'wi_gate, wi_up, wo' if self.gated_ffn else 'wi, wo'} (or: mlp)")
        check_expert_targets(self)

    def _check_fields(self):
        """Each field alone: its type, range, or one of its choices (a table's names)."""
        o = "model"
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            check_number(o, name, getattr(self, name), int, low=1)
        for name in ("n_kv_heads", "head_dim", "d_ff", "sliding_window"):
            check_number(o, name, getattr(self, name), int, low=1, optional=True)
        check_number(o, "rope_theta", self.rope_theta, float, low=1, low_open=True)
        check_number(o, "norm_eps", self.norm_eps, float, low=0, low_open=True)
        check_number(o, "dropout", self.dropout, float, low=0, high=1, high_open=True)
        for name in ("use_bias", "qkv_bias", "tie_embeddings", "tie_source_embed", "scan_layers",
                     "attn_sinks", "attn_output_gate", "embed_norm", "head_transform", "head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be true or false")
        check_choice(o, "arch", self.arch, ARCHS)
        check_number(o, "encoder_layers", self.encoder_layers, int, low=1, optional=True)
        check_choice(o, "position", self.position, POSITION_SCHEMES)
        check_choice(o, "norm", self.norm, NORMS)
        check_choice(o, "block", self.block, BLOCKS)
        check_choice(o, "ffn", self.ffn, FFNS)
        check_choice(o, "remat", self.remat, REMATS)
        check_choice(o, "attention_impl", self.attention_impl, (AUTO, *BACKENDS))
        for name, table in (("dtype", DTYPES), ("param_dtype", DTYPES),
                            ("matmul_precision", MATMUL_PRECISIONS)):
            check_choice(o, name, getattr(self, name), table)
        check_choice(o, "qk_norm", self.qk_norm, QK_NORMS)
        check_number(o, "rope_fraction", self.rope_fraction, float, low=0, low_open=True, high=1)
        check_number(o, "p_rope", self.p_rope, float, low=0, high=1)
        check_number(o, "mtp_depth", self.mtp_depth, int, low=0, high=8)
        if self.mtp_depth and not (self.causal and not ARCHS[self.arch].cross_attention):
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} needs model.arch=decoder")
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            check_number(o, name, getattr(self, name), float, low=0, low_open=True, optional=True)
        for name in ("embed_multiplier", "residual_multiplier", "logits_multiplier"):
            check_number(o, name, getattr(self, name), float, low=0, low_open=True)

    def _read_position_settings(self, set_):
        """position_settings as the scheme's settings class, the flat keys of earlier
        versions read into it (jaxformer.positions.schemes.read_settings)."""
        set_("position_settings", read_settings(
            self.position, self.position_settings, {k: getattr(self, k) for k in LEGACY_KEYS}))
        for old in LEGACY_KEYS:
            set_(old, None)

    def _read_pattern(self, set_):
        """layer_pattern and layer_kinds in their hashable forms (read_pattern)."""
        pattern, kinds = read_pattern(self.layer_pattern, self.layer_kinds)
        set_("layer_pattern", pattern)
        set_("layer_kinds", kinds)

    def _resolve_sizes(self, set_):
        """n_kv_heads, head_dim and d_ff where they are None."""
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.head_dim is None and self.mla.on:
            set_("head_dim", self.mla.qk_head_dim)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of "
                              f"model.n_kv_heads={self.n_kv_heads} (1 = MQA, n_heads = MHA)")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"model.d_model={self.d_model} is not divisible by "
                                  f"model.n_heads={self.n_heads}; change one, or set model.head_dim")
            set_("head_dim", self.d_model // self.n_heads)
        if self.d_ff is None:
            set_("d_ff", 64 * math.ceil(8 * self.d_model / 3 / 64) if self.gated_ffn
                 else 4 * self.d_model)

    def _check_together(self, set_):
        """Fields that must agree: the scheme's own checks, a bias scheme's backend, the
        arch's checks, RoPE scaling."""
        scheme = POSITION_SCHEMES[self.position]
        check_model(self)  # what the named attention backend cannot run
        ARCHS[self.arch].check(self)  # jaxformer.model.archs
        if self.mla.on:
            self.mla.check_model(self)
        for name in ("rope_fraction", "p_rope"):
            if getattr(self, name) != 1 and scheme.kind != "rotary":
                raise ConfigError(f"model.{name}={getattr(self, name)} needs a rotary position "
                                  f"scheme, not position={self.position!r}")
        check_position(self)  # its own check, and an encoder's refusals
        set_("rope_scaling", self._with_original(self.rope_scaling))
        check_pattern(self, scheme)  # jaxformer.model.layer_pattern
        check_mixers(self, scheme)
        check_layer_forms(self)
        self.moe.sparse(self.n_layers)  # model.moe.layers within 0..n_layers - 1, or one line
        if self.rope_scaling.row.scales and scheme.kind != "rotary":
            rotary = " or ".join(f"model.position={n!r}" for n in schemes_of("rotary"))
            raise ConfigError(f"model.rope_scaling.kind={self.rope_scaling.kind!r} needs "
                              f"{rotary} (got {self.position!r})")

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """Each layer's mixer (jaxformer.model.mixers.MIXERS): its kind's."""
        return tuple(self.kinds[i].mixer for i in self.layer_kind_ids)

    @property
    def layer_ffns(self) -> tuple[bool, ...]:
        """Whether each layer has a feed-forward network."""
        return tuple(self.kinds[i].ffn for i in self.layer_kind_ids)

    layer_parallels = property(layer_parallels)  # each layer's parallel mixer, or None

    @property
    def recurrent(self) -> bool:
        """Some layer's mixer (or parallel mixer) is recurrent (a fixed-size state)."""
        return any(MIXERS[m].recurrent for m in self.layer_mixers + self.layer_parallels if m)

    def recurrent_cache(self, layer: int):
        """Layer `layer`'s recurrent (or parallel) mixer's cache {name: (shape, dtype)}, or None."""
        name = self.layer_parallels[layer] or self.layer_mixers[layer]
        shapes = MIXERS[name].cache
        return None if shapes is None else shapes(self, self.mixer_settings(name))

    def mixer_settings(self, name: str):
        """Mixer `name`'s settings (model.mixer.<name>, its defaults where not given)."""
        return settings_of(self.mixer, name)

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """The layer kinds, resolved (window, RoPE base and scaling filled in from the model's
        fields), indexed by kind id; one kind when there is no layer pattern."""
        if not self.layer_pattern:
            return (LayerKind(window=self.sliding_window, rope_theta=self.rope_theta,
                              rope_scaling=self.rope_scaling),)
        return tuple(dataclasses.replace(
            k, rope_theta=self.rope_theta if k.rope_theta is None else k.rope_theta,
            rope_scaling=self.rope_scaling if k.rope_scaling is None
            else self._with_original(k.rope_scaling)) for _, k in self.layer_kinds)

    def _with_original(self, s: RopeScaling) -> RopeScaling:
        """s with original_max_seq_len filled from max_seq_len where its kind reads it."""
        if s.row.needs_original and s.original_max_seq_len is None:
            return dataclasses.replace(s, original_max_seq_len=self.max_seq_len)
        return s

    @property
    def layer_kind_ids(self) -> tuple[int, ...]:
        """Each layer's kind id (an index into `kinds`)."""
        if not self.layer_pattern:
            return (0,) * self.n_layers
        ids = {name: i for i, (name, _) in enumerate(self.layer_kinds)}
        p = self.layer_pattern
        return tuple(ids[p[i % len(p)]] for i in range(self.n_layers))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["layer_pattern"] = list(self.layer_pattern)
        out["layer_kinds"] = {n: dataclasses.asdict(k) for n, k in self.layer_kinds}
        out["lora"] = self.lora.to_dict()
        out["moe"] = self.moe.to_dict()
        out["mla"] = self.mla.to_dict()
        out["mixer"] = {n: dataclasses.asdict(m) for n, m in self.mixer} or None
        return out

    SECTION = "model"  # from_dict, to_dict, replace: jaxformer.core.validation.Section

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named architecture, e.g. ``ModelConfig.preset("gpt2-small", dropout=0.1)``."""
        return cls.from_dict(preset_values(name, overrides))

    @property
    def encoder_n_layers(self) -> int:
        """The encoder stack's layers (arch=encoder_decoder): encoder_layers, None meaning
        n_layers."""
        return self.encoder_layers or self.n_layers

    def stack(self, arch: str) -> "ModelConfig":
        """arch=encoder_decoder: one stack as a model of its own, without the fields only an
        encoder-decoder has: its encoder (an arch without the causal rule: encoder_n_layers
        layers; the model builds it) or its decoder (flops_per_token counts each)."""
        layers = self.n_layers if ARCHS[arch].causal else self.encoder_n_layers
        return self.replace(arch=arch, n_layers=layers, encoder_layers=None,
                            tie_source_embed=False)

    @property
    def causal(self) -> bool:
        """Self-attention has the causal rule (all but an encoder); the masks read it."""
        return ARCHS[self.arch].causal

    @property
    def generates(self) -> bool:
        """Decodes token by token with a KV cache (all but an encoder)."""
        return ARCHS[self.arch].generates

    @property
    def gated_ffn(self) -> bool:
        return FFNS[self.ffn].gated

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's feed-forward network is the mixture of experts (model.moe)."""
        return self.moe.sparse(self.n_layers)

    @property
    def layer_runs(self) -> tuple[Run, ...]:
        """The runs of consecutive alike layers (FFN, mixer, parallel mixer) scan_layers stacks."""
        return runs(tuple(zip(self.sparse_layers, layer_forms(self))))

    @property
    def expert_d_ff(self) -> int:
        """Each routed expert's width (model.moe.d_ff, else d_ff)."""
        return self.moe.d_ff or self.d_ff

    @property
    def shared_d_ff(self) -> int:
        """The shared experts' width together (0: none)."""
        return self.moe.shared_d_ff or self.moe.shared_experts * self.expert_d_ff


# the model's fields that are sections of their own (model.rope_scaling.kind=yarn)
NESTED = {"rope_scaling": RopeScaling, "lora": LoRAConfig, "moe": MoEConfig, "mla": MLAConfig}
