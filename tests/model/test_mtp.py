"""Multi-token prediction (jaxformer.model.mtp) and its loss
(jaxformer.training.objectives.language_model): the loss of a random model against a float64
NumPy forward written from the definition (DeepSeek-V3 section 2.2), packed rows included;
the main model untouched by the modules; the config's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.validation import ConfigError
from jaxformer.training.config import load_config
from jaxformer.training.objectives.language_model import MultiTokenLM

EPS = 1e-5
CFG = ModelConfig(vocab_size=48, d_model=16, n_layers=1, n_heads=2, max_seq_len=32,
                  norm="rmsnorm", norm_eps=EPS, ffn="swiglu", d_ff=24, use_bias=False,
                  tie_embeddings=False, mtp_depth=2)


def random_params(cfg, seed):
    """The model's params redrawn: kernels N(0, 0.3), norm scales 1 + N(0, 0.1)."""
    params = Transformer(cfg).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [1 + 0.1 * jax.random.normal(k, x.shape) if "scale" in jax.tree_util.keystr(p)
           else 0.3 * jax.random.normal(k, x.shape) for k, (p, x) in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


# ---- the float64 reference ---------------------------------------------------------


def rms(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * scale


def rope(x, pos):  # x [T, N, H], pos [T]: half-rotation pairs (i, i + H/2)
    h = x.shape[-1] // 2
    freq = 10000.0 ** (-np.arange(h) / h)
    ang = pos[:, None, None] * freq  # [T, 1, H/2]
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def block(p, x, pos, seg):
    """A pre-LN block on one row x [T, D]: attention within a segment, causal, then SwiGLU."""
    a = p["attn"]
    h = rms(x, p["attn_norm"]["scale"])
    q, k, v = (np.einsum("td,dnh->tnh", h, a[n]["kernel"]) for n in ("query", "key", "value"))
    q, k = rope(q, pos), rope(k, pos)
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(q.shape[-1])
    t = np.arange(x.shape[0])
    allowed = (t[:, None] >= t[None]) & (seg[:, None] == seg[None])
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    x = x + np.einsum("nhd,tnh->td", a["out"]["kernel"], np.einsum("nts,snh->tnh", w, v))
    f = p["ffn"]
    h = rms(x, p["ffn_norm"]["scale"])
    g = h @ f["wi_gate"]["kernel"]
    return x + (g / (1 + np.exp(-g)) * (h @ f["wi_up"]["kernel"])) @ f["wo"]["kernel"]


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference_losses(p, tokens, targets, mask, pos, seg, depth):
    """Per row: the main model, then module k on [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]
    -> eh_proj -> block -> its norm -> the head. Returns (main mean CE, [D] mean CEs)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), p)
    emb, head = p["embed"]["embedding"], p["lm_head"]["kernel"]
    main, sums, counts = [], np.zeros(depth), np.zeros(depth)
    for r in range(tokens.shape[0]):
        x = block(p["block_0"], emb[tokens[r]], pos[r], seg[r])
        lp = log_softmax(rms(x, p["final_norm"]["scale"]) @ head)
        main.append(-lp[np.arange(len(x)), targets[r]] * mask[r])
        h, t = x, len(x)
        for k in range(1, depth + 1):
            m = p[f"mtp_{k}"]
            nxt = np.concatenate([tokens[r, k:], np.zeros(k, int)])  # t_{i+k}
            joined = np.concatenate([rms(emb[nxt], m["enorm"]["scale"]),
                                     rms(h, m["hnorm"]["scale"])], -1)
            h = block(m["block"], joined @ m["eh_proj"]["kernel"], pos[r], seg[r])
            lp = log_softmax(rms(h, m["norm"]["scale"]) @ head)
            for i in range(t - k):  # t_{i+k+1} = targets[i + k]
                if mask[r, i + k] and seg[r, i] == seg[r, i + k]:
                    sums[k - 1] -= lp[i, targets[r, i + k]]
                    counts[k - 1] += 1
    return np.sum(main) / np.sum(mask), sums / counts


def packed_batch(rng, b=2, t=12):
    """Two rows, the first of two documents (its positions restarting), the second of one
    with padding at its end (segment 0, off the loss mask)."""
    stream = rng.integers(0, CFG.vocab_size, (b, t + 1))
    seg = np.array([[1] * 5 + [2] * (t - 5), [1] * (t - 3) + [0] * 3])
    pos = np.array([list(range(5)) + list(range(t - 5)), list(range(t))])
    mask = np.ones((b, t), np.float32)
    mask[0, 4] = 0  # its target starts the next document
    mask[1, t - 4:] = 0  # the last real token's target is padding, and the padding's
    return {"inputs": stream[:, :-1], "targets": stream[:, 1:], "loss_mask": mask,
            "segment_ids": seg.astype(np.int32), "positions": pos.astype(np.int32)}


@pytest.mark.parametrize("chunk", [0, 5])
def test_mtp_loss_equals_float64_reference(chunk):
    """The plain loss (mtp_terms) and, with model.loss_chunk=5, the chunked one (the head
    and each depth's loss 5 positions at a time: mtp_chunked_terms)."""
    rng = np.random.default_rng(0)
    params, batch = random_params(CFG, 0), packed_batch(rng)
    model = Transformer(CFG)
    total, count, _, sums, counts = jax.jit(lambda p, b: MultiTokenLM(chunk=chunk).terms(
        model, p, b))(params, batch)
    main, each = reference_losses(params, batch["inputs"], batch["targets"],
                                  batch["loss_mask"], batch["positions"],
                                  batch["segment_ids"], CFG.mtp_depth)
    np.testing.assert_allclose(float(total / count), main, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(sums / counts), each, rtol=2e-5)
    train, (_, _, metric_sums) = jax.jit(lambda p, b: MultiTokenLM(
        weight=0.1, chunk=chunk).train_loss(model, p, b))(params, batch)
    np.testing.assert_allclose(float(train / count), main + 0.1 * np.mean(each), rtol=2e-5)
    got = MultiTokenLM().metrics(metric_sums, count)
    np.testing.assert_allclose([got["mtp_loss_1"], got["mtp_loss_2"]], each, rtol=2e-5)


def test_main_model_is_the_model_without_modules():
    """The main logits of a model with MTP modules are those of its params without them in
    a model with mtp_depth=0 (whose params hold no module)."""
    params = random_params(CFG, 3)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 9)))
    plain = CFG.replace(mtp_depth=0)
    bare = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    assert set(Transformer(plain).init(jax.random.key(0), tokens)["params"]) == set(bare)
    want = Transformer(plain).apply({"params": bare}, tokens)
    logits, more = Transformer(CFG).apply({"params": params}, tokens, mtp=True)
    assert more.shape == (2, 2, 9, CFG.vocab_size)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)  # one head call for all
    np.testing.assert_array_equal(Transformer(CFG).apply({"params": params}, tokens), want)


def test_settings_read_and_refused():
    cfg = load_config(None, ["model.mtp_depth=2", "train.mtp_weight=0.1"])
    assert (cfg.model.mtp_depth, cfg.train.mtp_weight) == (2, 0.1)
    with pytest.raises(ConfigError, match="model.mtp_depth=1 needs model.arch=decoder"):
        ModelConfig(arch="encoder", mtp_depth=1)
    with pytest.raises(ConfigError, match="mtp_depth"):
        ModelConfig(mtp_depth=9)
    with pytest.raises(ConfigError, match="mtp_weight"):
        load_config(None, ["train.mtp_weight=-1"])
