"""The settings of a data table's entry (a format of jaxformer.data.formats, a tokenizer
kind of jaxformer.data.tokenizer_kinds): a frozen dataclass whose fields are data keys,
``data.<PREFIX><field>`` (bpe's vocab_size is data.bpe_vocab_size; a format's fields
have no prefix), each checked by the class that owns it."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from jaxformer.core.validation import ConfigError


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of every entry's settings class (a frozen dataclass of its own fields)."""

    PREFIX: ClassVar[str] = ""  # its fields' data keys are PREFIX + field name

    @classmethod
    def keys(cls) -> dict[str, str]:
        """data key -> field name, in field order."""
        return {cls.PREFIX + f.name: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """data key -> its default value."""
        return dict(cls().by_key())

    @classmethod
    def of(cls, values) -> "Settings":
        """The settings that an object with the data keys as attributes (a DataConfig)
        holds, checked by this class."""
        return cls(**{name: getattr(values, key) for key, name in cls.keys().items()})

    def by_key(self) -> list[tuple[str, Any]]:
        """(data key, value) of each field, in field order."""
        return [(key, getattr(self, name)) for key, name in self.keys().items()]


def check_field_names(settings: Settings) -> None:
    """Each field (a record field or column the data is read from) is a non-empty string."""
    for key, value in settings.by_key():
        if not isinstance(value, str) or not value:
            raise ConfigError(f"data.{key}={value!r} must be a field name")


def owners(table: Mapping, key: str) -> list[str]:
    """The names of a table's entries whose settings hold the data key `key`."""
    return [name for name, entry in table.items() if key in entry.settings.keys()]


def check_foreign(cfg, table: Mapping, chosen: str, field: str) -> None:
    """A data key of the table's other entries (not of `chosen`, the value of data.`field`)
    keeps its default: a saved config names every key, but a set one means another entry."""
    mine = table[chosen].settings.keys()
    for entry in table.values():
        for key, default in entry.settings.defaults().items():
            value = getattr(cfg, key)
            if key not in mine and value != default:
                them = " or ".join(f"data.{field}={n}" for n in owners(table, key))
                raise ConfigError(f"data.{key}={value!r} is a setting of {them}, not of "
                                  f"data.{field}={chosen}; drop it, or set {them}")
