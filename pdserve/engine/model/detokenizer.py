"""Token ids to text, for the two places that need it.

`IncrementalDetokenizer` (a node front, streaming) emits only text that can no longer change. A
token can end in the middle of a UTF-8 character (decoded as U+FFFD until the next token arrives)
and a stop string can start in this chunk and finish in a later one, so the tail that could still
change is held back until the next token or the end.

`StopDetokenizer` (a rank, stop strings) decodes a window of output ids, statelessly: the same ids
give the same text on every PP rank, which a per-request stream could not promise.
"""

from __future__ import annotations

import threading

from pdserve.engine.model.path import resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer, plain_tokenizer_json


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
        assert self._backend is not None  # the stream is made only where there is a backend
        try:
            for t in token_ids:
                piece = self._stream.step(self._backend, t)
                if piece:
                    self._streamed += piece
        except Exception:  # an id the tokenizer lacks: decode in full from now on
            self._stream = None
            return self.text()
        return self._streamed

    def resume(self, token_ids: list[int], emitted: int) -> None:
        """Continues a stream another node began: `token_ids` were generated there and the client
        has the first `emitted` characters of their text (router/routing/migration.py). Raises
        ValueError when `emitted` is more than their text has."""
        full = self._extend(token_ids)
        if not 0 <= emitted <= len(full):
            raise ValueError(f"{emitted} characters sent, but the tokens' text has {len(full)}")
        self.emitted = emitted

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


class StopDetokenizer:
    """`ids -> text` for stop-string checks on a rank, loaded on first use (most requests have no
    stop strings; a prefill rank never checks one). With a tokenizer.json (a HF folder, or a cached
    GGUF tokenizer) it is the `tokenizers` library alone, quick to load and no transformers import,
    which
    decodes exactly like transformers' fast tokenizer unless the tokenizer asks for the clean-up
    of tokenization spaces; otherwise the transformers tokenizer."""

    def __init__(self, path):
        self.path = resolve_model(path)
        self._decode = None
        self._lock = threading.Lock()

    def __call__(self, ids: list[int]) -> str:
        if self._decode is None:
            with self._lock:
                if self._decode is None:
                    self._decode = self._load()
        return self._decode(ids)

    def _load(self):
        tj = plain_tokenizer_json(self.path)
        if tj is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tj))
        else:
            tok = load_tokenizer(self.path)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)
