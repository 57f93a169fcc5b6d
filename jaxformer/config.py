"""ModelConfig: the one switchboard of the model, validated when it is built."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxformer.backends import AUTO, BACKENDS
from jaxformer.positions import ROPE_SCALINGS, RopeScaling  # noqa: F401
from jaxformer.presets import PRESETS
from jaxformer.schemes import POSITION_SCHEMES, schemes_of
from jaxformer.validation import ConfigError, Section, check_choice, check_number  # noqa: F401

SINUSOIDAL_SCALES = ("table", "tokens", "unit")
NORMS = ("layernorm", "rmsnorm")
BLOCKS = ("pre_ln", "post_ln")
FFNS = ("gelu", "gelu_exact", "relu", "swiglu", "geglu")
REMATS = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Every architectural choice of a decoder-only transformer.

    None fields are resolved at construction: n_kv_heads -> n_heads, qkv_bias -> use_bias,
    head_dim -> d_model // n_heads, d_ff -> 4 * d_model (gelu/relu) or
    8/3 * d_model rounded up to a multiple of 64 (swiglu/geglu).

    position (jaxformer.positions): rope, alibi, t5 (T5's learned bias per head and
    relative-position bucket; t5_num_buckets and t5_max_distance as in T5), fire (Li et
    al. 2023's MLP of the normalised log distance), sinusoidal, learned (a table of
    max_seq_len rows), none (NoPE). The t5 and fire biases are computed once per forward
    and shared by every layer.
    sinusoidal_scale: how the unit-amplitude sinusoidal table meets token embeddings
    initialised at std 0.02. table: the table / sqrt(d_model), the token-to-position ratio
    of Vaswani et al.'s embeddings * sqrt(d_model) with the embeddings left as they are;
    tokens: Vaswani et al.'s form, embeddings * sqrt(d_model) + table; unit: table as is
    (its RMS of 0.71 per dimension swamps the tokens ~35:1).
    """

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
    sinusoidal_scale: str = "table"
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
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
    scan_layers: bool = False
    remat: str = "none"
    sliding_window: int | None = None
    attention_impl: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        elif isinstance(self.rope_scaling, str):
            set_("rope_scaling", RopeScaling(kind=self.rope_scaling))
        elif not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} must be a RopeScaling, "
                              "a mapping of its fields, or a kind name")
        if self.qkv_bias is None:
            set_("qkv_bias", self.use_bias)
        self._check_fields()
        self._resolve_sizes(set_)
        self._check_together(set_)

    def _check_fields(self):
        """Each field alone: its type, range, or one of its choices (a table's names)."""
        o = "model"
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len",
                     "t5_max_distance"):
            check_number(o, name, getattr(self, name), int, low=1)
        for name in ("n_kv_heads", "head_dim", "d_ff", "sliding_window"):
            check_number(o, name, getattr(self, name), int, low=1, optional=True)
        check_number(o, "rope_theta", self.rope_theta, float, low=1, low_open=True)
        check_number(o, "norm_eps", self.norm_eps, float, low=0, low_open=True)
        check_number(o, "dropout", self.dropout, float, low=0, high=1, high_open=True)
        for name in ("use_bias", "qkv_bias", "tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be true or false")
        check_choice(o, "position", self.position, POSITION_SCHEMES)
        check_choice(o, "sinusoidal_scale", self.sinusoidal_scale, SINUSOIDAL_SCALES)
        check_number(o, "t5_num_buckets", self.t5_num_buckets, int, low=4)
        check_choice(o, "norm", self.norm, NORMS)
        check_choice(o, "block", self.block, BLOCKS)
        check_choice(o, "ffn", self.ffn, FFNS)
        check_choice(o, "remat", self.remat, REMATS)
        check_choice(o, "attention_impl", self.attention_impl, (AUTO, *BACKENDS))
        check_choice(o, "dtype", self.dtype, DTYPES)
        check_choice(o, "param_dtype", self.param_dtype, DTYPES)

    def _resolve_sizes(self, set_):
        """n_kv_heads, head_dim and d_ff where they are None."""
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of "
                              f"model.n_kv_heads={self.n_kv_heads} (1 = MQA, n_heads = MHA)")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"model.d_model={self.d_model} is not divisible by "
                                  f"model.n_heads={self.n_heads}; change one, or set model.head_dim")
            set_("head_dim", self.d_model // self.n_heads)
        if self.d_ff is None:
            gated = self.ffn in ("swiglu", "geglu")
            set_("d_ff", 64 * math.ceil(8 * self.d_model / 3 / 64) if gated else 4 * self.d_model)

    def _check_together(self, set_):
        """Fields that must agree: the scheme's own checks, a bias scheme's backend, the
        T5 buckets, RoPE scaling."""
        scheme = POSITION_SCHEMES[self.position]
        backend = BACKENDS.get(self.attention_impl)
        if scheme.kind == "bias" and backend is not None and not backend.takes_bias:
            takers = [n for n, b in BACKENDS.items() if b.takes_bias and b.rule is not None]
            raise ConfigError(
                f"model.attention_impl={self.attention_impl!r} adds no bias to the logits, so "
                f"position={self.position!r} cannot use it; use attention_impl="
                f"{' or '.join(map(repr, takers))} (or {AUTO!r}), or "
                f"{'/'.join(n for n, s in POSITION_SCHEMES.items() if s.kind != 'bias')} positions")
        if scheme.check is not None:
            scheme.check(self)
        if self.t5_max_distance <= self.t5_num_buckets // 2:
            raise ConfigError(f"model.t5_max_distance={self.t5_max_distance} must exceed "
                              f"half of model.t5_num_buckets={self.t5_num_buckets}: the first "
                              "half of the buckets are exact distances, the rest log-spaced up "
                              "to t5_max_distance")
        if self.rope_scaling.kind in ("yarn", "llama3") and \
                self.rope_scaling.original_max_seq_len is None:
            set_("rope_scaling", dataclasses.replace(self.rope_scaling,
                                                     original_max_seq_len=self.max_seq_len))
        if self.rope_scaling.kind != "none" and scheme.kind != "rotary":
            rotary = " or ".join(f"model.position={n!r}" for n in schemes_of("rotary"))
            raise ConfigError(f"model.rope_scaling.kind={self.rope_scaling.kind!r} needs "
                              f"{rotary} (got {self.position!r})")

    SECTION = "model"  # from_dict, to_dict, replace: jaxformer.validation.Section

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named architecture, e.g. ``ModelConfig.preset("gpt2-small", dropout=0.1)``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}")
        values = {**PRESETS[name], **overrides}
        if isinstance(overrides.get("rope_scaling"), Mapping) and \
                isinstance(PRESETS[name].get("rope_scaling"), Mapping):
            values["rope_scaling"] = {**PRESETS[name]["rope_scaling"], **overrides["rope_scaling"]}
        return cls.from_dict(values)

    @property
    def gated_ffn(self) -> bool:
        return self.ffn in ("swiglu", "geglu")

