"""A request's text as its tokens arrive: incremental detokenisation (a token that ends
inside a character waits for the next), stop strings (the text cut before the first one
found, and text that may be the start of one held back until it is not), and the tokens
each piece of text carries, for their log-probs.

    text = TextStream(tokenizer, stop=("\\n\\n",), skip_ids={eot})
    piece = text.add(event)      # the text now safe to send ("" while held back)
    text.stopped                 # a stop string was found: the request ends
    piece += text.finish()       # at the end: whatever was held back
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that end inside a character


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-prob and its top alternatives (id, log-prob)."""
    token: int
    text: str                  # the token decoded alone
    offset: int                # where its text starts in the request's text
    logprob: float
    top: tuple[tuple[int, float], ...]


class TextStream:
    """The text of one request's generated tokens, released piece by piece."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_ids: Iterable[int] = ()):
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop may span
        self.skip_ids = frozenset(skip_ids)
        self.ids: list[int] = []
        self.text = ""            # decoded so far (up to read_offset)
        self.sent = 0             # chars of self.text released
        self.prefix_offset = 0    # ids[prefix_offset:read_offset] decode to the text's tail
        self.read_offset = 0
        self.stopped = False
        self.ended = False        # finish() was called
        self.tokens: list[TokenLogprob] = []   # every token whose text was (or will be) sent
        self.generated = 0                     # tokens the engine gave, the skipped ones too
        self.reported = 0                      # tokens returned by new_tokens

    def add(self, event) -> str:
        """Take one Event's token; the text that may be sent now."""
        if self.stopped or event.token < 0:
            return ""
        self.generated += 1
        if event.token in self.skip_ids:  # an end-of-text token: not part of the text
            return ""
        self.ids.append(int(event.token))
        # the text so far is the tokens' before it, less a character they end inside,
        # which this token's text then starts in (so it starts where that character does)
        self.tokens.append(TokenLogprob(int(event.token), self.tok.decode([event.token]),
                                        len(self.text), float(event.logprob),
                                        tuple(event.top)))
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back, at the request's end."""
        self.ended = True
        if not self.stopped:
            self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        """Extend self.text by the ids past read_offset, unless they end inside a character
        (and more may come)."""
        before = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        after = self.tok.decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT)):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._find_stop()

    def _find_stop(self) -> None:
        """Cut the text at the first stop string in it (search where a new one may start)."""
        start = max(self.sent - self.hold, 0)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        """The text past what was sent, less the tail a stop string might still begin."""
        end = len(self.text) if final or self.stopped else max(len(self.text) - self.hold,
                                                                self.sent)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def kept_tokens(self) -> list[TokenLogprob]:
        """The tokens whose text starts inside the text kept (all of them unless a stop
        string cut it: the stop string's own tokens are not the text's)."""
        if not self.stopped:
            return list(self.tokens)
        return [t for t in self.tokens if t.offset < len(self.text)]

    def new_tokens(self) -> list[TokenLogprob]:
        """The kept tokens whose text starts in the text released (all, once finished)
        and that no earlier call returned: a streamed chunk's."""
        kept = self.kept_tokens()
        ready = len(kept) if self.ended else sum(t.offset < self.sent for t in kept)
        fresh, self.reported = kept[self.reported:ready], max(ready, self.reported)
        return fresh
