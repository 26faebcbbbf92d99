"""Incremental detokenization with stop strings.

Text is released as soon as it cannot change: never half a UTF-8 character, and never the
tail that might still turn out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: tuple[str, ...] = ()):
        self._decode = decode
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (truncated at a stop string once stopped)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False

    def update(self, token_ids: Sequence[int]) -> str:
        """Decode the generated ids so far; return the newly releasable text."""
        text = self._decode(token_ids)
        if self.stop:
            start = max(0, self.emitted - self._hold)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = text[:min(hits)], True
                return self.flush()
        self.text = text
        ready = len(text) - self._hold
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            ready = min(ready, len(text.rstrip("\ufffd")))
        if ready <= self.emitted:
            return ""
        delta, self.emitted = text[self.emitted:ready], ready
        return delta

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
