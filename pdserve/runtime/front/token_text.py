"""The text and raw bytes of each token, for logprobs (OpenAI's `token` and `bytes`).

A token's bytes are its own (a byte-level BPE token can hold half of a UTF-8 character). Its text is
what it adds to the output: the characters its bytes complete, decoded incrementally along the
answer, so the sampled tokens' texts concatenate to the output text; a token that starts a
character and does not finish it has the text "" and the next one the whole character. Special
tokens, which the output text leaves out, have their own content as text ("<|im_end|>") and take
no part in that decoding. Alternatives (top logprobs) are decoded alone, invalid bytes as U+FFFD.
Sentencepiece tokens ("▁the", "<0xE2>") are turned into their bytes too; a sentencepiece decoder
that strips the answer's first space is not imitated.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (as in its byte-level BPE), reversed."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class TokenBytes:
    """Raw bytes per token id of one tokenizer (cached; shared by the requests of a node)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            piece = self.tok.convert_ids_to_tokens(token_id) or ""
            if token_id in self.special:
                raw = piece.encode()
            elif self.byte_level and all(c in _BYTE_LEVEL for c in piece):
                raw = bytes(_BYTE_LEVEL[c] for c in piece)
            elif m := _SP_BYTE.fullmatch(piece):
                raw = bytes([int(m.group(1), 16)])
            else:
                raw = piece.replace("▁", " ").encode()
            self._cache[token_id] = raw
        return raw


class TokenText:
    """Logprob entries with text for one request: `[id, logprob, top, text, bytes]`, each top entry
    `[id, logprob, text, bytes]` (bytes as a list of ints)."""

    def __init__(self, token_bytes: TokenBytes):
        self.bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def entry(self, token_id: int, logprob: float, top: list | None) -> list[Any]:
        raw = self.bytes(token_id)
        text = raw.decode() if token_id in self.bytes.special else self._utf8.decode(raw)
        alts = [
            [t, lp, self.bytes(t).decode("utf-8", "replace"), list(self.bytes(t))]
            for t, lp in (top or [])
        ]
        return [token_id, logprob, alts, text, list(raw)]
