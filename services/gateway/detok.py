"""Incremental detokenization: the text of a request's tokens, streamed as the tokens come.

Decoding each message's tokens apart breaks a character whose bytes span tokens (byte-level BPE,
byte-fallback tokens) into U+FFFD. As in vLLM and text-generation-inference, the detokenizer keeps the
request's token ids and decodes a window of them twice: the tokens already emitted at its start
(``ids[prefix:read]``, context for merges and spaces that depend on the token before) and the window
with the new tokens (``ids[prefix:]``). The difference is emitted once it does not end in U+FFFD (an
incomplete character); until then it is held back.

Invariants: the texts returned by ``push`` and then ``flush`` concatenate to ``tokenizer.decode(ids)``
(for tokenizers whose decode of a sequence is that of its parts, as byte-level BPE's is). Tokens are
taken one at a time, so the state is a function of the ids alone: a resumed attempt rebuilds it from
the tokens already sent (``Detokenizer(tokenizer, sent)``) and emits nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterable

INCOMPLETE = "\ufffd"     # what decode makes of the bytes of a character not complete yet


class Detokenizer:
    """The text of one request's tokens, piece by piece. ``tokenizer``: a ``tokenizers.Tokenizer``, or
    None (the model has no tokenizer.json: every text is "")."""

    __slots__ = ("tokenizer", "ids", "prefix", "read", "context")

    def __init__(self, tokenizer, ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0   # ids[prefix:read]: emitted, kept as context; ids[read:]: held back
        self.context = ""             # decode(ids[prefix:read])
        self.push(ids)                # the tokens an earlier attempt sent: their text was sent with them

    def push(self, ids: Iterable[int]) -> str:
        """The new text that ``ids`` (appended to the request's tokens) complete; "" while held back."""
        if self.tokenizer is None:
            return ""
        return "".join([self._one(t) for t in ids])

    def flush(self) -> str:
        """The text held back, at the end of the request (an incomplete character stays U+FFFD there,
        as in the decode of all the tokens)."""
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        return self._advance(self._decode(self.prefix))

    def _one(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode(self.prefix)
        if len(text) > len(self.context) and not text.endswith(INCOMPLETE):
            return self._advance(text)
        return ""

    def _advance(self, text: str) -> str:
        """Emit ``text`` (the window's decode) past the context; the new tokens become the context."""
        new = text[len(self.context):]
        self.prefix, self.read = self.read, len(self.ids)
        self.context = self._decode(self.prefix)
        return new

    def _decode(self, start: int) -> str:
        return self.tokenizer.decode(self.ids[start:])
