"""``TextStream``: one request's generated token ids turned into text as they come,
with stop strings.

Decoding is incremental: each new id decodes a window of the last few ids, not the
whole output, so a token costs O(window), not O(output). Text is held back while
* the window ends inside a multi-byte character (the decoder yields U+FFFD), or
* the text ends with a prefix of a stop string (it may complete on the next token),
so a client never sees text that is later taken back. A stop string ends the request;
neither it nor anything after it is emitted.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted as text
        self._read = 0  # ids before this were decoded into ``_text``
        self._text = ""  # decoded so far, emitted or held back
        self._emitted = 0  # characters of ``_text`` handed out
        self.stopped = False  # a stop string was seen; nothing more is emitted

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._emitted]

    def push(self, token_id: int) -> str:
        """Take one generated id; return the text that may be emitted now (maybe '')."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended (EOS or length): the text still held back."""
        if self.stopped:
            return ""
        rest = self._decode(self._ids[self._read :])  # an unfinished character, if any
        self._text += rest
        self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text, start = self._text, self._emitted
        if self._stop:
            scan = max(0, start - max(map(len, self._stop)) + 1)
            hits = [i for i in (text.find(s, scan) for s in self._stop) if i >= 0]
            if hits:
                end = max(min(hits), start)
                self.stopped = True
                self._emitted = end
                return text[start:end]
        end = len(text)
        if not final:
            for s in self._stop:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, len(text) - start), 0, -1):
                    if text.endswith(s[:k]):
                        end = min(end, len(text) - k)
                        break
        self._emitted = end
        return text[start:end]
