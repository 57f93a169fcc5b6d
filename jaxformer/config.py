"""ModelConfig: the one switchboard of the model, validated when it is built."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

POSITIONS = ("rope", "alibi", "sinusoidal", "learned", "none", "t5", "fire")
SINUSOIDAL_SCALES = ("table", "tokens", "unit")
ROPE_SCALINGS = ("none", "linear", "ntk", "yarn", "llama3")
NORMS = ("layernorm", "rmsnorm")
BLOCKS = ("pre_ln", "post_ln")
FFNS = ("gelu", "relu", "swiglu", "geglu")
REMATS = ("none", "full", "dots")
ATTENTION_IMPLS = ("auto", "reference", "xla", "cudnn", "chunked", "blockwise", "splash")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config field has a bad value; the message names the field and what it accepts."""


def _check_choice(owner: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{name}={value!r} is not one of {', '.join(allowed)}")


def _check_number(owner: str, name: str, value: Any, kind: type, *, low=None, low_open=False,
                  high=None, high_open=False, optional=False) -> None:
    if value is None and optional:
        return
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{owner}.{name}={value!r} must be {'an int' if kind is int else 'a number'}"
                          f"{' or None' if optional else ''}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(f"{owner}.{name}={value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ConfigError(f"{owner}.{name}={value!r} must be {'<' if high_open else '<='} {high}")


def _reject_unknown(cls, keys, owner: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(keys) - set(names))
    if unknown:
        raise ConfigError(f"unknown {owner} field(s) {', '.join(unknown)}; "
                          f"valid fields are: {', '.join(names)}")


def _from_mapping(cls, values: Mapping[str, Any], owner: str):
    _reject_unknown(cls, values, owner)
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched to reach past the training length.

    kind: none | linear (positions / factor) | ntk (theta * factor^(d/(d-2))) |
      yarn (Peng et al. 2023, per-frequency ramp + attention temperature) |
      llama3 (Meta's Llama 3.1 wavelength-band rule).
    original_max_seq_len: the length the model was trained at (yarn, llama3);
      None means ModelConfig.max_seq_len.
    """

    kind: str = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 * ln(factor) + 1

    def __post_init__(self):
        o = "rope_scaling"
        _check_choice(o, "kind", self.kind, ROPE_SCALINGS)
        _check_number(o, "factor", self.factor, float, low=0, low_open=True)
        if self.kind in ("ntk", "yarn", "llama3") and self.factor < 1:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be >= 1 for kind={self.kind}")
        _check_number(o, "original_max_seq_len", self.original_max_seq_len, int, low=1, optional=True)
        _check_number(o, "low_freq_factor", self.low_freq_factor, float, low=0, low_open=True)
        _check_number(o, "high_freq_factor", self.high_freq_factor, float, low=0, low_open=True)
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("rope_scaling.high_freq_factor must be > low_freq_factor "
                              f"(got {self.high_freq_factor} <= {self.low_freq_factor})")
        _check_number(o, "beta_fast", self.beta_fast, float, low=0, low_open=True)
        _check_number(o, "beta_slow", self.beta_slow, float, low=0, low_open=True)
        _check_number(o, "attention_factor", self.attention_factor, float, low=0, low_open=True,
                      optional=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RopeScaling":
        return _from_mapping(cls, values, "rope_scaling")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
        o = "model"
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        elif isinstance(self.rope_scaling, str):
            set_("rope_scaling", RopeScaling(kind=self.rope_scaling))
        elif not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} must be a RopeScaling, "
                              "a mapping of its fields, or a kind name")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len",
                     "t5_max_distance"):
            _check_number(o, name, getattr(self, name), int, low=1)
        for name in ("n_kv_heads", "head_dim", "d_ff", "sliding_window"):
            _check_number(o, name, getattr(self, name), int, low=1, optional=True)
        _check_number(o, "rope_theta", self.rope_theta, float, low=1, low_open=True)
        _check_number(o, "norm_eps", self.norm_eps, float, low=0, low_open=True)
        _check_number(o, "dropout", self.dropout, float, low=0, high=1, high_open=True)
        if self.qkv_bias is None:
            set_("qkv_bias", self.use_bias)
        for name in ("use_bias", "qkv_bias", "tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be true or false")
        _check_choice(o, "position", self.position, POSITIONS)
        _check_choice(o, "sinusoidal_scale", self.sinusoidal_scale, SINUSOIDAL_SCALES)
        _check_number(o, "t5_num_buckets", self.t5_num_buckets, int, low=4)
        _check_choice(o, "norm", self.norm, NORMS)
        _check_choice(o, "block", self.block, BLOCKS)
        _check_choice(o, "ffn", self.ffn, FFNS)
        _check_choice(o, "remat", self.remat, REMATS)
        _check_choice(o, "attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice(o, "dtype", self.dtype, DTYPES)
        _check_choice(o, "param_dtype", self.param_dtype, DTYPES)

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
        if self.attention_impl == "splash" and self.position in ("alibi", "t5", "fire"):
            raise ConfigError(f"model.attention_impl='splash' adds no bias to the logits, so "
                              f"position={self.position!r} cannot use it; use "
                              "attention_impl='blockwise' (or 'auto'), or rope/none/learned/"
                              "sinusoidal positions")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} is odd; RoPE rotates pairs of "
                              "dimensions and needs an even head_dim")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model.d_model={self.d_model} is odd; sinusoidal positions "
                              "pair sin and cos and need an even d_model")
        if self.t5_max_distance <= self.t5_num_buckets // 2:
            raise ConfigError(f"model.t5_max_distance={self.t5_max_distance} must exceed "
                              f"half of model.t5_num_buckets={self.t5_num_buckets}: the first "
                              "half of the buckets are exact distances, the rest log-spaced up "
                              "to t5_max_distance")
        if self.rope_scaling.kind in ("yarn", "llama3") and \
                self.rope_scaling.original_max_seq_len is None:
            set_("rope_scaling", dataclasses.replace(self.rope_scaling,
                                                     original_max_seq_len=self.max_seq_len))
        if self.rope_scaling.kind != "none" and self.position != "rope":
            raise ConfigError(f"model.rope_scaling.kind={self.rope_scaling.kind!r} needs "
                              f"model.position='rope' (got {self.position!r})")

    # ---- construction helpers -------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a plain mapping (YAML, JSON); unknown keys are an error."""
        return _from_mapping(cls, values, "model")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        _reject_unknown(type(self), changes, "model")
        return dataclasses.replace(self, **changes)

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


_GPT2 = dict(vocab_size=50257, max_seq_len=1024, position="learned", norm="layernorm",
             norm_eps=1e-5, block="pre_ln", ffn="gelu", use_bias=True, tie_embeddings=True)
_LLAMA = dict(position="rope", norm="rmsnorm", block="pre_ln", ffn="swiglu", use_bias=False,
              tie_embeddings=False)

PRESETS: dict[str, dict[str, Any]] = {
    # Trains on 2 CPU cores in minutes: byte vocabulary, RoPE, pre-LN.
    "tiny": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=256),
    "gpt2-small": dict(_GPT2, d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": dict(_GPT2, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-large": dict(_GPT2, d_model=1280, n_layers=36, n_heads=20),
    "llama2-7b": dict(_LLAMA, vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      d_ff=11008, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": dict(_LLAMA, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                      norm_eps=1e-5),
    "llama3.1-8b": dict(_LLAMA, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                        n_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                        norm_eps=1e-5,
                        rope_scaling=dict(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_seq_len=8192)),
}
