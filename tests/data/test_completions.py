"""Prompt/completion records (jaxformer.data.completions): packing, the loss on the
completion alone, and the errors a bad file gets."""

import json

import jax
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.data import DataConfig, DataError, load_dataset
from jaxformer.data.completions import pack, rows_batch
from jaxformer.model.config import ConfigError
from jaxformer.training.step import loss_sums

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def load(path, tmp_path, **kw):
    cfg = DataConfig(path=str(path), format="prompt_completion", cache_dir=str(tmp_path / "c"),
                     **kw)
    return load_dataset(cfg, run_dir=str(tmp_path / "run"), vocab_size=256, progress=False,
                        log=lambda *a: None)


def test_records_pack_as_written_by_hand(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "cd"},
                                              {"prompt": "x", "completion": "yz"},
                                              {"prompt": "hello", "completion": "!"}])
    data = load(path, tmp_path, val_fraction=0.0)
    batch = data.train_batch(seed=0, step=0, batch_size=1, seq_len=8)
    bounds = data.packed("train", 8)
    assert list(bounds) == [0, 2, 3]  # "ab|cd" (3 inputs) + "x|yz" (2) fit 8; "hello|!" not
    first = {k: v[0] for k, v in rows_batch(data.train, bounds, np.array([0]), 8).items()}
    assert list(first["inputs"]) == [97, 98, 99, 120, 121, 0, 0, 0]
    assert list(first["targets"]) == [98, 99, 100, 121, 122, 0, 0, 0]
    assert list(first["loss_mask"]) == [0, 1, 1, 1, 1, 0, 0, 0]
    assert list(first["segment_ids"]) == [1, 1, 1, 2, 2, 0, 0, 0]
    assert list(first["positions"]) == [0, 1, 2, 0, 1, 0, 0, 0]
    assert batch["inputs"].shape == (1, 8)


def test_the_loss_is_the_float64_nll_of_the_completions_alone(tmp_path):
    letters = np.array(list("abcdefghij klmnop"))
    records = [{"question": "".join(rng.choice(letters, rng.integers(0, 8))) + "?",
                "answer": "".join(rng.choice(letters, rng.integers(1, 7)))} for _ in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    data = load(path, tmp_path, prompt_field="question", completion_field="answer",
                val_fraction=0.1)
    assert len(data.train) == 36 and len(data.val) == 4
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=4, max_seq_len=32,
                      position="learned")  # absolute: positions must restart
    model = Transformer(cfg)
    params = jax.jit(model.init)(jax.random.key(int(rng.integers(1 << 30))),
                                 np.zeros((1, 4), np.int32))["params"]  # one program
    batch = data.train_batch(seed=int(rng.integers(1 << 30)), step=3, batch_size=4, seq_len=24)
    total, count = (float(x) for x in jax.jit(lambda p, b: loss_sums(model, p, b))(params, batch))
    # each record of the batch alone: its completion tokens' NLL in float64 (each record is
    # a row of its own, zero-padded at the end to one width, all rows in one call: a
    # causal model's logits at a position see nothing after it)
    packed = []  # each record's tokens: its inputs, then its last target
    for r in range(4):
        for seg in range(1, int(batch["segment_ids"][r].max()) + 1):
            at = batch["segment_ids"][r] == seg
            packed.append(np.concatenate([batch["inputs"][r][at], batch["targets"][r][at][-1:]]))
    alone = np.zeros((len(packed), 24), np.int32)  # [records, 24]
    for row, ids in zip(alone, packed):
        row[:len(ids) - 1] = ids[:-1]
    logits = np.float64(jax.jit(model.apply)({"params": params}, alone))  # [records, 24, V]
    want, n = 0.0, 0
    for ids, z in zip(packed, logits):
        logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - z.max(-1, keepdims=True)
        prompt_len = bytes(ids.tolist()).decode().index("?") + 1  # prompts end at "?"
        for i in range(prompt_len - 1, len(ids) - 1):  # completion targets only
            want -= logp[i, ids[i + 1]]
            n += 1
    assert count == n
    np.testing.assert_allclose(total, want, rtol=2e-6)


def test_bad_records_are_named(tmp_path):
    bad = [([{"prompt": "a", "completion": ""}], r"d.jsonl:1: the completion is empty"),
           ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}],
            r"d.jsonl:2: field 'completion' is missing"),
           ([{"prompt": 3, "completion": "b"}], r"d.jsonl:1: field 'prompt' is int, not text")]
    for records, match in bad:
        path = write_jsonl(tmp_path / "d.jsonl", records)
        with pytest.raises(DataError, match=match):
            load(path, tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no completion tokens"):
        load(tmp_path / "empty.jsonl", tmp_path)
    with pytest.raises(ConfigError, match="reads a .jsonl or .parquet file"):
        load(tmp_path, tmp_path)


def test_parquet_records(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["ab", "x"], "completion": ["cd", "yz"]}),
                   tmp_path / "d.parquet")
    data = load(tmp_path / "d.parquet", tmp_path, val_fraction=0.0)
    batch = data.train_batch(seed=0, step=0, batch_size=2, seq_len=8)
    assert set(batch["loss_mask"].sum(1)) == {4.0}  # both rows hold the one packed row
    with pytest.raises(DataError, match="no column 'answer'"):
        load(tmp_path / "d.parquet", tmp_path, completion_field="answer")


def _record(slots):
    """A record of slots + 1 random letters (slots inputs), split at random into a prompt
    (possibly empty) and a non-empty completion."""
    text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), slots + 1))
    cut = int(rng.integers(0, slots + 1))
    return {"prompt": text[:cut], "completion": text[cut:]}


def _expected_rows(rows, seq_len):
    """The packed arrays written from the module docstring: per row, its records' bytes
    (cut to seq_len + 1) one after another; inputs the tokens but the last, targets but
    the first, loss on completion targets, segments 1, 2, ..., positions from 0; padding 0."""
    out = {k: np.zeros((len(rows), seq_len), np.int64)
           for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    for r, row in enumerate(rows):
        at = 0
        for seg, rec in enumerate(row, 1):
            ids = list((rec["prompt"] + rec["completion"]).encode())[:seq_len + 1]
            weight = [0] * len(rec["prompt"]) + [1] * len(rec["completion"])
            n = len(ids) - 1
            out["inputs"][r, at:at + n] = ids[:-1]
            out["targets"][r, at:at + n] = ids[1:]
            out["loss_mask"][r, at:at + n] = weight[1:n + 1]
            out["segment_ids"][r, at:at + n] = seg
            out["positions"][r, at:at + n] = range(n)
            at += n
    return out


def test_records_that_exactly_fill_a_row_stay_in_it(tmp_path):
    """Records whose inputs fill a row's last slot exactly (two, three, or one of exactly
    seq_len + 1 tokens, or one cut to that) share the row; one slot too many opens the
    next: the bounds and every packed array against the layout written by hand."""
    seq_len = int(rng.integers(6, 13))
    a, e = int(rng.integers(1, seq_len)), int(rng.integers(2, seq_len))
    b = int(rng.integers(1, seq_len - 1))
    c = int(rng.integers(1, seq_len - b))
    rows = [[_record(a), _record(seq_len - a)],                       # exactly full
            [_record(seq_len)],                                       # seq_len + 1 tokens
            [_record(seq_len + int(rng.integers(1, 4)))],             # cut to seq_len + 1
            [_record(b), _record(c), _record(seq_len - b - c)],       # exactly full
            [_record(e)],                                             # the next: 1 too many
            [_record(seq_len + 1 - e)]]
    path = write_jsonl(tmp_path / "d.jsonl", [rec for row in rows for rec in row])
    data = load(path, tmp_path, val_fraction=0.0)
    bounds, cut = pack(data.train, seq_len)
    assert bounds.tolist() == [0, 2, 3, 4, 7, 8, 9] and cut == 1
    got = rows_batch(data.train, bounds, np.arange(len(rows)), seq_len)
    for k, want in _expected_rows(rows, seq_len).items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)
    assert (got["segment_ids"][:4] > 0).all()  # the full rows have no padding


def test_the_end_of_text_id_follows_the_completion_and_is_learned(tmp_path):
    """With a tokenizer.json that has <|endoftext|> (a word-level one, built offline, its
    ids shuffled): each record is prompt + completion + EOT, the EOT a target in the loss,
    and no EOT after the prompt: the packed rows against the ids written by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|endoftext|>"] + [f"w{i}" for i in range(20)]
    ids = rng.permutation(len(words))
    vocab = dict(zip(words, ids.tolist()))
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    eot = vocab["<|endoftext|>"]

    seq_len, records, rows, at = 16, [], [[]], 0
    for _ in range(6):
        prompt = list(rng.choice(words[2:], int(rng.integers(0, 4))))
        completion = list(rng.choice(words[2:], int(rng.integers(1, 4))))
        records.append({"prompt": " ".join(prompt), "completion": " ".join(completion)})
        toks = [vocab[w] for w in prompt + completion] + [eot]
        weight = [0] * len(prompt) + [1] * (len(completion) + 1)
        if at + len(toks) - 1 > seq_len:
            rows.append([])
            at = 0
        rows[-1].append((toks, weight))
        at += len(toks) - 1
    path = write_jsonl(tmp_path / "d.jsonl", records)
    data = load(path, tmp_path, val_fraction=0.0, tokenizer=str(tmp_path / "tokenizer.json"))
    assert data.tokenizer.eot_id == eot
    bounds = data.packed("train", seq_len)
    assert len(bounds) - 1 == len(rows)
    got = rows_batch(data.train, bounds, np.arange(len(rows)), seq_len)
    for r, row in enumerate(rows):
        inputs, targets, mask = [], [], []
        for toks, weight in row:
            inputs += toks[:-1]
            targets += toks[1:]
            mask += weight[1:]
        pad = [0] * (seq_len - len(inputs))
        assert got["inputs"][r].tolist() == inputs + pad, r
        assert got["targets"][r].tolist() == targets + pad, r
        assert got["loss_mask"][r].tolist() == mask + pad, r
    # every record's last target is the EOT, in the loss
    last = np.diff(got["segment_ids"], append=0, axis=1) != 0
    assert last.sum() == len(records)
    assert (got["targets"][last] == eot).all() and (got["loss_mask"][last] == 1).all()


@pytest.mark.parametrize("fmt, group", [("prompt_completion", 1), ("preference", 2)])
def test_prompts_that_fill_the_cut_are_refused_not_trained_on(tmp_path, fmt, group):
    """Every record's prompt at least seq_len // group + 1 tokens: nothing of any answer
    survives the cut, a one-line error (not a loss of 0); one prompt a token shorter
    leaves a target to learn."""
    seq_len = int(rng.integers(8, 40))
    most = seq_len // group + 1
    letters = np.array(list("abcdefgh"))
    text = lambda n: "".join(rng.choice(letters, n))  # noqa: E731
    answers = ("completion",) if group == 1 else ("chosen", "rejected")
    records = [dict(prompt=text(int(rng.integers(most, 3 * most))),
                    **{a: text(int(rng.integers(1, 9))) for a in answers})
               for _ in range(int(rng.integers(2, 12)))]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = DataConfig(path=str(path), format=fmt, cache_dir=str(tmp_path / "c"), val_fraction=0)
    logged = []
    data = load_dataset(cfg, vocab_size=256, progress=False, log=logged.append)
    answer = "completion" if group == 1 else "answer"
    with pytest.raises(DataError) as err:
        data.train_batch(seed=0, step=0, batch_size=2, seq_len=seq_len)
    assert str(err.value).endswith(
        f"every train {answer} is cut off: its prompt fills "
        f"{'seq_len + 1' if group == 1 else 'seq_len // 2 + 1'} = {most} tokens; raise "
        "train.seq_len or shorten the prompts") and "\n" not in str(err.value)
    assert logged[-1].startswith(f"data: {len(records) * group} of {len(records) * group:,} "
                                 "train sequences are longer than")
    records[int(rng.integers(len(records)))]["prompt"] = text(most - 1)
    data = load_dataset(cfg.replace(path=str(write_jsonl(tmp_path / "e.jsonl", records))),
                        vocab_size=256, progress=False, log=logged.append)
    assert data.train_batch(seed=0, step=0, batch_size=2, seq_len=seq_len)["inputs"].shape \
        == (2, seq_len)
