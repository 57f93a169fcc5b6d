"""Prompts as token ids: a model folder's chat template (the `chat_template` of its
tokenizer_config.json, or chat_template.jinja) rendered with jinja2 in the sandboxed
environment transformers renders it in, and the end-of-text ids that end a request.

    chat = ChatTemplate.of_folder("path/to/model")      # None without a template
    text = chat.render([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


def _json(path: pathlib.Path) -> dict:
    """A folder's JSON file as a dict ({} when absent)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def _raise(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def of_folder(cls, folder) -> ChatTemplate | None:
        """The folder's template: chat_template.jinja, else chat_template.json's, else
        tokenizer_config.json's chat_template (a string, or named templates: the "default"
        one); None if none."""
        folder = pathlib.Path(folder)
        config = _json(folder / CONFIG_FILE)
        source = _json(folder / "chat_template.json").get("chat_template") or \
            config.get("chat_template")
        if (folder / TEMPLATE_FILE).is_file():
            source = (folder / TEMPLATE_FILE).read_text()
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not source:
            return None
        return cls(source, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], **variables) -> str:
        """The prompt text of these messages, ending where the assistant's reply begins."""
        from jinja2.exceptions import TemplateError
        try:
            return self._compiled().render(
                messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=True, **variables)
        except (TemplateError, TypeError, ValueError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"the chat template refused the messages: {message}") from None

    def _compiled(self):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.source)


def special_token_encoder(tokenizer, add_special_tokens: bool = False):
    """encode(text) -> ids that reads special tokens written in the text (a chat
    template's <|im_start|>) as their ids, as transformers' tokenizers do; with
    add_special_tokens, also those the tokenizer.json's post-processor puts around a text
    (a BOS), as transformers and vLLM encode a completion's prompt (a rendered chat has
    its template's). jaxformer's own byte tokenizer reads them as text and adds none."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return lambda text: [int(i) for i in tokenizer.encode(text)]
    from tokenizers import Tokenizer
    copy = Tokenizer.from_str(hf.to_str())
    copy.encode_special_tokens = False
    return lambda text: copy.encode(text, add_special_tokens=add_special_tokens).ids


def end_ids(folder, tokenizer) -> tuple[int, ...]:
    """The ids that end a request: the tokenizer's end-of-text and generation_config.json's
    eos_token_id (an int or a list), when the folder has one."""
    ids = [] if tokenizer.eot_id is None else [int(tokenizer.eot_id)]
    eos = _json(pathlib.Path(folder) / "generation_config.json").get("eos_token_id")
    ids += [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    return tuple(dict.fromkeys(ids))
