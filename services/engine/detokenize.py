"""Incremental detokenization with stop strings, for streaming text to clients."""

from __future__ import annotations


class TextStream:
    """Incremental detokenizer with stop strings.

    Holds back text that may still change: an incomplete UTF-8 sequence (decodes to U+FFFD)
    and any tail that could be the start of a stop string. A stop string ends the output
    before itself; an `end_after` string ends it after itself (it is sent).

    Each token decodes a window of a few ids, not the whole output (which made a token's cost
    grow with its position: 176 us at 4,096 tokens with a 32k byte-level BPE): the ids from
    `_prefix` on, whose text past that of ids[_prefix:_read] is new. The window starts one
    settled stretch back, so that a tokenizer whose decode depends on the neighbouring token
    (sentencepiece drops the leading space of the first one) decodes the new ids in context;
    it moves on when its text ends on a whole character (no U+FFFD at the end), so the text is
    the same as decoding all the ids at once.
    """

    def __init__(self, tokenizer: object, stop: tuple[str, ...], skip_special: bool = True,
                 end_after: tuple[str, ...] = ()):
        """skip_special: special tokens are not text (False: they are, as written)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._stop = tuple(s for s in stop if s)
        self._end_after = tuple(s for s in end_after if s)
        self._ids: list[int] = []
        self._prefix = 0  # the window's first id
        self._read = 0  # ids before this one are in _text
        self._prefix_text = ""  # the text of ids[_prefix:_read], as the window decodes it
        self._text = ""  # the text of ids[:_read]
        self._emitted = 0  # chars of _text already sent

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(  # type: ignore[attr-defined]
            ids, skip_special_tokens=self._skip_special)

    def _settle(self, final: bool) -> None:
        """Move the window's new text into _text if it ends on a whole character (or if no
        more ids come: `final`)."""
        window = self._decode(self._ids[self._prefix:])
        if not final and window.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: the next id may complete it
        self._text += window[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text now safe to send, whether a stop string ended the output)."""
        self._ids.append(token_id)
        self._settle(final=False)
        for stop in self._stop:
            found = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if found != -1:
                out = self._text[self._emitted:found]
                self._emitted = len(self._text)
                return out, True
        for end in self._end_after:
            found = self._text.find(end, max(0, self._emitted - len(end) + 1))
            if found != -1:
                out = self._text[self._emitted:found + len(end)]
                self._emitted = len(self._text)
                return out, True
        safe = len(self._text) - self._stop_prefix_len()
        out = self._text[self._emitted:max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return out, False

    def flush(self) -> str:
        if self._read < len(self._ids):
            self._settle(final=True)
        out = self._text[self._emitted:]
        self._emitted = len(self._text)
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of _text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:n]):
                    best = n
                    break
        return best
