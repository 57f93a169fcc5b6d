"""The data tables: data.format's entries (jaxformer.data.formats.FORMATS) and
data.tokenizer's kinds (jaxformer.data.tokenizer_kinds.TOKENIZERS). Each entry's settings
are data keys its own class checks; today's flat keys and a saved config.yaml's full dump
of every key still load; a key of another format is refused in one line; each format of
records reads the fields its settings name."""

import dataclasses
import json
import string

import numpy as np
import pytest

from jaxformer.core.validation import ConfigError
from jaxformer.data import DataConfig, load_dataset
from jaxformer.data.formats import FORMATS
from jaxformer.data.prepare import read_data_config
from jaxformer.data.tokenizer_kinds import TOKENIZERS, BpeSettings, tokenizer_kind

# A run's config.yaml data section as runs before the tables wrote it (dataclasses.asdict
# of DataConfig: every key, each at its default here).
OLD_DUMP = {"path": None, "tokenizer": "bytes", "bpe_vocab_size": 4096,
            "bpe_train_bytes": 100000000, "val_fraction": 0.05, "text_field": "text",
            "bin_dtype": "uint16", "pack": False, "cache_dir": None, "format": "text",
            "prompt_field": "prompt", "completion_field": "completion",
            "chosen_field": "chosen", "rejected_field": "rejected", "source_field": "source",
            "target_field": "target", "mixture": None}


def word(rng, n=None) -> str:
    """A random field name (lower-case letters)."""
    return "".join(rng.choice(list(string.ascii_lowercase), n or int(rng.integers(3, 10))))


def text(rng) -> str:
    return "".join(rng.choice(list(string.ascii_letters + " .,"), int(rng.integers(1, 30))))


def path_for(name: str) -> str | None:
    return "records.jsonl" if FORMATS[name].records else None


def test_the_keys_are_the_entries_settings_and_a_dump_keeps_its_shape():
    """DataConfig's keys are its own plus every entry's settings keys, each with the
    entry's default; a config dumps every key as it did (the old dump's keys, in order)."""
    owned = {}
    for table in (FORMATS, TOKENIZERS):
        for entry in table.values():
            for key, default in entry.settings.defaults().items():
                assert owned.setdefault(key, default) == default, key  # shared keys agree
    fields = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert owned.items() <= fields.items()
    assert list(DataConfig().to_dict()) == list(OLD_DUMP) and DataConfig().to_dict() == OLD_DUMP


@pytest.mark.parametrize("name", FORMATS)
def test_a_saved_full_dump_loads_with_the_format_s_settings(name, rng):
    """An old full dump loads, each key where it was, and the format's settings read the
    chosen format's keys: defaults, then random values of its own keys."""
    dump = {**OLD_DUMP, "format": name, "path": path_for(name)}
    cfg = DataConfig.from_dict(dump)
    assert cfg.to_dict() == dump
    own = FORMATS[name].settings.keys()
    assert dict(cfg.format_settings.by_key()) == {k: OLD_DUMP[k] for k in own}
    values = {key: word(rng) for key in own}
    cfg = read_data_config(None, [f"data.{k}={v}" for k, v in {**dump, **values}.items()
                                  if v is not None])  # as typed on the command line
    assert dict(cfg.format_settings.by_key()) == values
    assert {k: getattr(cfg, k) for k in values} == values


@pytest.mark.parametrize("name", FORMATS)
def test_a_key_of_another_format_is_refused_in_one_line(name, rng):
    """Every key of the other formats (not of this one) may stay at its default, and is
    refused in one line naming the key and the format(s) that take it when set."""
    base = {"format": name, "path": path_for(name)}
    own = FORMATS[name].settings.keys()
    foreign = {k for f in FORMATS.values() for k in f.settings.keys()} - set(own)
    assert foreign
    for key in sorted(foreign):
        DataConfig(**base, **{key: OLD_DUMP[key]})
        value = word(rng)
        with pytest.raises(ConfigError) as e:
            DataConfig(**base, **{key: value})
        message = str(e.value)
        takers = [n for n, f in FORMATS.items() if key in f.settings.keys()]
        assert "\n" not in message and message.startswith(f"data.{key}={value!r} is a setting")
        assert all(f"data.format={t}" in message for t in takers) and name in message


def test_a_format_s_own_class_checks_its_keys(rng):
    """An empty field name is refused by the class of the format that owns it, in one
    line naming the key."""
    for name, fmt in FORMATS.items():
        for key in fmt.settings.keys():
            with pytest.raises(ConfigError, match=f"^data.{key}='' must be a"):
                DataConfig(format=name, path=path_for(name), **{key: ""})


def test_today_s_keys_on_the_command_line(rng):
    """data.format=preference data.chosen_field=..., data.tokenizer=bpe
    data.bpe_vocab_size=... set the chosen entry's settings; a bpe key stays accepted
    when a config's tokenizer is overridden by a tokenizer.json (a preset's bpe_* keys)."""
    chosen, size = word(rng), int(rng.integers(257, 1 << 16))
    cfg = read_data_config(None, ["data.format=preference", "data.path=p.jsonl",
                                  f"data.chosen_field={chosen}"])
    assert cfg.format_settings.chosen_field == chosen and cfg.format_entry.batch == "pairs"
    cfg = read_data_config(None, ["data.tokenizer=bpe", f"data.bpe_vocab_size={size}"])
    assert cfg.tokenizer_settings == BpeSettings(vocab_size=size, train_bytes=100_000_000)
    cfg = read_data_config(None, ["data.tokenizer=tok.json", f"data.bpe_vocab_size={size}"])
    assert cfg.tokenizer_entry.is_path and cfg.bpe_vocab_size == size
    with pytest.raises(ConfigError, match=r"^data.chosen_field='x' is a setting of "
                                          r"data.format=preference, not of data.format=text"):
        read_data_config(None, ["data.chosen_field=x"])


def test_tokenizer_kinds_are_chosen_by_name_or_claimed(rng, tmp_path):
    """A kind's own name chooses it; a .json path or a folder is claimed by the kind that
    reads files; anything else is refused in one line listing what data.tokenizer takes."""
    named = [n for n, k in TOKENIZERS.items() if k.claims is None]
    assert named and all(tokenizer_kind(n) == n for n in named)
    claiming = [n for n, k in TOKENIZERS.items() if k.claims is not None]
    assert len(claiming) == 1
    for value in (f"{word(rng)}/{word(rng)}.json", str(tmp_path)):
        assert tokenizer_kind(value) == claiming[0]
        assert DataConfig(tokenizer=value).tokenizer_entry is TOKENIZERS[claiming[0]]
    bad = word(rng, 12)
    with pytest.raises(ConfigError) as e:
        DataConfig(tokenizer=bad)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in named)


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.records])
def test_each_format_of_records_reads_the_fields_its_settings_name(name, rng, tmp_path):
    """Records under random field names, with decoys of other lengths under the default
    names, load under those names exactly as the same records written under the default
    names load with the default settings (and not as the decoys do)."""
    keys = FORMATS[name].settings.defaults()  # data key -> the default field name
    names = {key: word(rng) + "_" for key in keys}  # never a default name
    records = [{key: text(rng) for key in keys} for _ in range(int(rng.integers(8, 20)))]
    renamed = [{**{names[k]: v for k, v in r.items()},
                **{keys[k]: v + "~" * int(rng.integers(1, 4)) for k, v in r.items()}}
               for r in records]  # decoys under the default names
    plain = [{keys[k]: v for k, v in r.items()} for r in records]
    for file, rows in (("renamed.jsonl", renamed), ("plain.jsonl", plain)):
        (tmp_path / file).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def load(file, **settings):
        cfg = DataConfig(path=str(tmp_path / file), format=name, val_fraction=0.0,
                         cache_dir=str(tmp_path / "c"), **settings)
        return load_dataset(cfg, vocab_size=257, progress=False, log=lambda m: None)

    got, want, decoys = load("renamed.jsonl", **names), load("plain.jsonl"), load("renamed.jsonl")
    assert got.token_counts == want.token_counts != decoys.token_counts
    seed = int(rng.integers(1 << 30))
    a, b = (d.train_batch(seed=seed, step=0, batch_size=4, seq_len=64) for d in (got, want))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
