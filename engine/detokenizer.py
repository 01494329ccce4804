"""Incremental detokenization for streaming: emit only text that can no longer change.

A token can end in the middle of a UTF-8 character (decoded as U+FFFD until the next token arrives)
and a stop string can start in this chunk and finish in a later one, so the tail that could still
change is held back until the next token or the end.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text of a growing list of token ids. With a `tokenizers`-backed tokenizer each new token is
    decoded once, by the library's decode stream (O(1) per token; re-decoding the whole output per
    chunk was O(n^2)); `finish` decodes the whole output once, so the end is exact whatever the
    stream held back (an incomplete UTF-8 character shows as U+FFFD there, as in a full decode)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of the full text already sent
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if self._backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False
        ):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
        self._streamed = ""  # what the stream has produced so far

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def _extend(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        if self._stream is None:
            return self.text()
        try:
            for t in token_ids:
                piece = self._stream.step(self._backend, t)
                if piece:
                    self._streamed += piece
        except Exception:  # an id the tokenizer lacks: decode in full from now on
            self._stream = None
            return self.text()
        return self._streamed

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the new text that is safe to send now."""
        full = self._extend(token_ids)
        safe = len(full) - self.hold
        for s in self.stop:  # a stop string completed by these tokens: nothing from its start on
            i = full.find(s, max(0, self.emitted - len(s) + 1))
            if i >= 0:
                safe = min(safe, i)
        while safe > self.emitted and full[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.emitted:
            return ""
        out = full[self.emitted : safe]
        self.emitted = safe
        return out

    def finish(self, matched_stop: str | None) -> str:
        """The rest of the text at the end, cut before the stop string that ended the request."""
        full = self.text()
        if matched_stop:
            cut = full.find(matched_stop, max(0, self.emitted - len(matched_stop)))
            if cut >= 0:
                full = full[:cut]
        out = full[self.emitted :] if len(full) > self.emitted else ""
        self.emitted = max(self.emitted, len(full))
        return out
