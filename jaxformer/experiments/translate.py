"""Exact match of an encoder-decoder run on its held-out pairs:

    python -m jaxformer.experiments.translate --run runs/transformer_base [--beam-width 4
        --alpha 0.6 --greedy --limit N --batch-size 100]

Loads the run's config, tokenizer and latest checkpoint, decodes the source of every val
pair of its data (data.format=seq2seq: the same split training held out) by beam search
with GNMT's length penalty (or greedily), and prints the share whose decoded target equals
the reference exactly, with a few examples.
"""

from __future__ import annotations

import argparse

import numpy as np


def val_pairs(data, limit: int | None = None):
    """The val (source ids, target ids) pairs of a Seq2SeqData, in order."""
    sources, targets = data.val
    n = len(sources) if limit is None else min(limit, len(sources))
    cut = lambda r, i: r.tokens[r.offsets[i]:r.offsets[i + 1]]  # noqa: E731
    return [(cut(sources, i), cut(targets, i)) for i in range(n)]


def decode_pairs(model, params, pairs, end: int, *, beam_width: int, alpha: float,
                 greedy: bool, batch_size: int, max_new_tokens: int):
    """Each pair's decoded target ids (up to its end id)."""
    from jaxformer.decode.seq2seq import seq2seq_beam_search, seq2seq_generate

    out = []
    width = max(len(s) for s, _ in pairs)
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        source = np.zeros((batch_size, width), np.int32)  # one shape: one compile
        lengths = np.ones(batch_size, np.int32)
        for i, (s, _) in enumerate(chunk):
            source[i, :len(s)], lengths[i] = s, len(s)
        kw = dict(bos_id=end, eos_id=end, max_new_tokens=max_new_tokens, source_lengths=lengths)
        if greedy:
            tokens = seq2seq_generate(model, params, source, **kw).tokens
        else:
            tokens = seq2seq_beam_search(model, params, source, beam_width=beam_width,
                                         alpha=alpha, **kw).tokens
        for row in np.asarray(tokens)[:len(chunk)]:
            stop = np.flatnonzero(row == end)
            out.append(row[:stop[0]] if len(stop) else row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Exact match of an encoder-decoder run.")
    p.add_argument("--run", required=True, help="a training run directory (train.run_dir)")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6, help="GNMT's length penalty")
    p.add_argument("--greedy", action="store_true", help="greedy decoding, not beam search")
    p.add_argument("--limit", type=int, default=None, help="the first N val pairs only")
    p.add_argument("--batch-size", type=int, default=100)
    a = p.parse_args(argv)

    from jaxformer.data import load_dataset
    from jaxformer.data.seq2seq import end_id
    from jaxformer.training.saved_run import load_run_params
    from jaxformer.model.encoder_decoder import EncoderDecoder

    cfg, params = load_run_params(a.run)
    data = load_dataset(cfg.data, run_dir=a.run, vocab_size=cfg.model.vocab_size,
                        progress=False, log=lambda *args: None)
    pairs, end = val_pairs(data, a.limit), end_id(data.tokenizer)
    longest = max(len(t) for _, t in pairs) + 1
    got = decode_pairs(EncoderDecoder(cfg.model), params, pairs, end, beam_width=a.beam_width,
                       alpha=a.alpha, greedy=a.greedy, batch_size=a.batch_size,
                       max_new_tokens=min(2 * longest, cfg.model.max_seq_len - 1))
    right = [np.array_equal(g, t) for g, (_, t) in zip(got, pairs)]
    text = data.tokenizer.decode
    for (s, t), g in list(zip(pairs, got))[:5]:
        print(f"{text(s)!r} -> {text(g)!r} (reference {text(t)!r})")
    how = "greedy" if a.greedy else f"beam {a.beam_width}, alpha {a.alpha}"
    print(f"exact match ({how}): {sum(right)}/{len(right)} = {np.mean(right):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
