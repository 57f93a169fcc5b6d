"""data.mixture: each row of a batch from a source drawn with the mixture's weights (a
pure function of seed, step and row, so any split of the rows over processes reads the
same batch), the sources' shares over a run at their weights, every window a window of
its own source, and the config's one-line errors. Training (resume, per-source val loss):
tests/training/test_mixture_training.py."""

import numpy as np
import pytest

from jaxformer.core.validation import ConfigError
from jaxformer.data import DataConfig, DataError, load_dataset
from jaxformer.data.mixture import row_sources


def write_sources(rng, tmp_path, sizes=(3000, 2000)):
    """Two text files of disjoint alphabets (lowercase letters, digits): a window's bytes
    say which file it came from."""
    paths = []
    for name, alphabet, n in zip(("letters", "digits"), (b"abcdefghij \n", b"0123456789 \n"),
                                 sizes):
        path = tmp_path / f"{name}.txt"
        path.write_bytes(bytes(rng.choice(list(alphabet), n).tolist()))
        paths.append(path)
    return paths


def test_rows_follow_the_weights_and_come_from_their_source(rng, tmp_path):
    letters, digits = write_sources(rng, tmp_path)
    data = load_dataset(DataConfig(mixture=f"{letters}:0.8,{digits}:0.2",
                                   cache_dir=str(tmp_path / "cache"), val_fraction=0.1),
                        vocab_size=256, progress=False, log=lambda m: None)
    seed, batch_size, seq_len = int(rng.integers(1 << 30)), 20, 16
    rows = 0
    from_letters = 0
    for step in range(50):  # 1,000 rows
        batch = data.train_batch(seed=seed, step=step, batch_size=batch_size, seq_len=seq_len)
        second_half = data.train_batch(seed=seed, step=step, batch_size=batch_size,
                                       seq_len=seq_len, rows=slice(10, 20))  # process 2 of 2
        np.testing.assert_array_equal(second_half["inputs"], batch["inputs"][10:])
        source = row_sources(seed, step, batch_size, [0.8, 0.2])
        text = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
        is_letters = np.all((text >= ord("a")) | (text == 32) | (text == 10), axis=1)
        is_digits = np.all((text < ord("a")), axis=1)
        np.testing.assert_array_equal(is_letters, source == 0)
        np.testing.assert_array_equal(is_digits, source == 1)
        rows += batch_size
        from_letters += int(is_letters.sum())
    assert rows == 1000 and abs(from_letters / rows - 0.8) < 0.02, from_letters / rows
    again = data.train_batch(seed=seed, step=7, batch_size=batch_size, seq_len=seq_len)
    np.testing.assert_array_equal(again["inputs"], data.train_batch(
        seed=seed, step=7, batch_size=batch_size, seq_len=seq_len)["inputs"])


@pytest.mark.parametrize("spec, words", [
    ("a.txt:0.8", "two or more sources"),
    ("a.txt:0.8,b/a.txt:0.2", "different file names"),
    ("a.txt,b.txt:1", "is not PATH:WEIGHT"),
    ("a.txt:x,b.txt:1", "is not a number"),
    ("a.txt:0,b.txt:1", "must be a finite number > 0"),
    ("a.txt:inf,b.txt:1", "'a.txt:inf': the weight must be a finite number > 0"),
    ("a.txt:1,b.txt:nan", "'b.txt:nan': the weight must be a finite number > 0"),
    ("a.txt:1,b.txt:-inf", "must be a finite number > 0"),
])
def test_bad_mixtures_are_one_line(spec, words):
    with pytest.raises(ConfigError) as err:
        DataConfig(mixture=spec)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("other, words", [(dict(path="x.txt"), "data.path"),
                                          (dict(tokenizer="bpe"), "data.tokenizer")])
def test_mixture_refuses_what_it_cannot_read(other, words):
    with pytest.raises(ConfigError) as err:
        DataConfig(mixture="a.txt:1,b.txt:1", **other)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_yaml_list_is_the_same_mixture():
    listed = DataConfig(mixture=["a.txt:0.8", {"path": "b.jsonl", "weight": 0.2}])
    assert listed == DataConfig(mixture="a.txt:0.8,b.jsonl:0.2")


def test_every_slice_of_a_batch_mixes_the_sources_in_their_weights(rng, tmp_path):
    """The rows of a batch are shuffled: each process's rows (a half, read with `rows`),
    each device's (a quarter) and each micro-batch (rows i, i + 2, ... with grad_accum 2)
    hold source A in the share the whole batch does. Given the batch's n_A rows of A, a
    slice of h of its B rows holds a hypergeometric count (mean n_A h / B, variance
    n_A (B - n_A) h (B - h) / (B^2 (B - 1))); summed over 100 steps, each slice's count is
    within 6 sigma of its mean. Rows in source order would put A's rows first: the first
    half 2.4 rows a step or more over its mean at a weight of A in [0.3, 0.7], over 20
    sigma in 100 steps."""
    letters, digits = write_sources(rng, tmp_path)
    w = float(rng.uniform(0.3, 0.7))
    data = load_dataset(DataConfig(mixture=f"{letters}:{w},{digits}:{1 - w}",
                                   cache_dir=str(tmp_path / "cache"), val_fraction=0.1),
                        vocab_size=256, progress=False, log=lambda m: None)
    seed, b, steps = int(rng.integers(1 << 30)), 16, 100
    slices = {"halves": np.arange(b).reshape(2, -1), "quarters": np.arange(b).reshape(4, -1),
              "micro-batches": np.arange(b).reshape(-1, 2).T}  # each row: a slice's rows
    counts = {k: np.zeros(len(v)) for k, v in slices.items()}  # source A's rows
    means = {k: 0.0 for k in slices}
    variances = {k: 0.0 for k in slices}
    for step in range(steps):
        halves = [data.train_batch(seed=seed, step=step, batch_size=b, seq_len=8,
                                   rows=slice(p * b // 2, (p + 1) * b // 2)) for p in (0, 1)]
        rows = np.concatenate([h["inputs"] for h in halves])  # [B, 8]
        is_a = np.all((rows >= ord("a")) | (rows == 32) | (rows == 10), axis=1)
        n_a = int(is_a.sum())
        assert abs(n_a - w * b) < 1  # the batch: floor or ceil of w B rows of A
        for k, index in slices.items():
            h = index.shape[1]
            counts[k] += is_a[index].sum(1)
            means[k] += n_a * h / b
            variances[k] += n_a * (b - n_a) * h * (b - h) / (b * b * (b - 1))
    for k in slices:
        bound = 6 * np.sqrt(variances[k])
        assert np.all(np.abs(counts[k] - means[k]) < bound), (k, counts[k], means[k], bound)


def test_a_missing_source_is_named_before_any_is_tokenised(rng, tmp_path, monkeypatch):
    letters, _ = write_sources(rng, tmp_path)
    missing = f"{rng.integers(1 << 30)}.txt"
    monkeypatch.chdir(tmp_path)
    spec = [f"{letters.name}:{rng.uniform(0.1, 1)}", f"{missing}:{rng.uniform(0.1, 1)}"]
    logged = []
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(mixture=",".join(spec[::rng.choice([1, -1])]),
                                cache_dir=str(tmp_path / "cache")),
                     progress=False, log=logged.append)
    assert str(err.value) == (f"data.mixture entry {missing!r} does not exist; point it at a "
                              "text/.jsonl/.parquet/.bin file or a folder")
    assert not logged and not (tmp_path / "cache").exists()  # nothing tokenised
