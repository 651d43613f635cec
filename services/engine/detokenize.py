"""Incremental detokenization with stop strings, for streaming text to clients."""

from __future__ import annotations


class TextStream:
    """Incremental detokenizer with stop strings.

    Holds back text that may still change: an incomplete UTF-8 sequence (decodes to U+FFFD)
    and any tail that could be the start of a stop string. A stop string ends the output
    before itself; an `end_after` string ends it after itself (it is sent).
    """

    def __init__(self, tokenizer: object, stop: tuple[str, ...], skip_special: bool = True,
                 end_after: tuple[str, ...] = ()):
        """skip_special: special tokens are not text (False: they are, as written)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._stop = tuple(s for s in stop if s)
        self._end_after = tuple(s for s in end_after if s)
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0  # chars of _text already sent

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text now safe to send, whether a stop string ended the output)."""
        self._ids.append(token_id)
        self._text = self._tokenizer.decode(  # type: ignore[attr-defined]
            self._ids, skip_special_tokens=self._skip_special)
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
        safe = len(self._text.rstrip("\ufffd"))
        safe -= self._stop_prefix_len(self._text[:safe])
        out = self._text[self._emitted:max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return out, False

    def flush(self) -> str:
        out = self._text[self._emitted:]
        self._emitted = len(self._text)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
