"""Logprob token text and bytes (runtime/front/token_text.py) on the tests' byte-level BPE
tokenizer: the sampled tokens' texts concatenate to the decoded text even where a character spans
tokens, and each token's bytes are its own, checked against transformers' GPT-2 byte table."""

from __future__ import annotations

import pytest
from tiny_model import build_tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdserve.runtime.front.token_text import TokenBytes, TokenText


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def own_bytes(tok, token_id: int) -> bytes:
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in tok.convert_ids_to_tokens(token_id))


def test_texts_concatenate_to_the_text_across_split_characters(tok):
    text = "h€llo 💡 the cache, ünï"
    ids = tok(text)["input_ids"]
    one = TokenText(TokenBytes(tok))  # one request's decoding state
    entries = [one.entry(t, -1.0, [[t, -1.0]]) for t in ids]
    assert "".join(e[3] for e in entries) == text == tok.decode(ids)
    assert b"".join(bytes(e[4]) for e in entries) == text.encode()
    assert [bytes(e[4]) for e in entries] == [own_bytes(tok, t) for t in ids]
    split = [e for e in entries if e[3] == ""]
    assert split, "the tokenizer splits € and 💡 into tokens holding parts of a character"
    assert all(bytes(e[4]) and bytes(e[4])[0] >= 0x80 for e in split)
    # an alternative is decoded alone: its own bytes, U+FFFD where they are no whole character
    alt = entries[1][2][0]
    assert alt[0] == ids[1] and bytes(alt[3]) == own_bytes(tok, ids[1])
    assert alt[2] == own_bytes(tok, ids[1]).decode("utf-8", "replace")


def test_special_tokens_keep_their_content_and_leave_the_decoding_alone(tok):
    one = TokenText(TokenBytes(tok))
    ids = tok("a é")["input_ids"]
    half = [one.entry(t, 0.0, None) for t in ids[:-1]]
    eos = one.entry(tok.eos_token_id, 0.0, None)
    rest = one.entry(ids[-1], 0.0, None)
    assert eos[3] == "<|im_end|>" and bytes(eos[4]) == b"<|im_end|>"
    assert "".join(e[3] for e in [*half, rest]) == "a é"
