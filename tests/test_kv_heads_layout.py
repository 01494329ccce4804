"""KV transfer between pools of different (PP, TP) layouts, at the layout level
(pdserve/kv_transfer/layout.py; docs/ARCHITECTURE.md section 15): every prefill rank's
descriptors to every decode rank are applied to real byte buffers, each byte of a prefill pool
named by its (token, layer, k/v, head, byte). After every pair moved its share:

- each decode rank holds exactly the model's KV for its layers and its heads, in its own pages;
- no descriptor writes outside the decode rank's pool, or reads outside the prefill rank's;
- the bytes each pair moves are the overlap of their layers and heads times the tokens
  (`kv_bytes` with `heads`; pools of the same heads and page size move whole pages), and no
  decode byte is written twice.

The PD nodes do not run TP yet (they refuse `--tp`); this is the mapping they will use.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pdserve.engine.model.config import split_layers
from pdserve.kv_transfer.layout import PoolDesc, build_descriptors, intersect
from pdserve.kv_transfer.stats import kv_bytes

LAYERS, HEADS, HEAD_BYTES = 6, 4, 3
TOKENS = 29  # not a multiple of either page size


def value(token: int, layer: int, kv: int, head: int, byte: int) -> int:
    return (token * 131 + layer * 31 + kv * 17 + head * 7 + byte * 3) % 251 + 1


class Pool:
    """One rank's pool as bytes, at its own base address; pages in a scrambled order."""

    def __init__(self, index: int, layers, heads, page_size: int, num_pages: int):
        h0, h1 = heads
        self.desc = PoolDesc(
            base_ptr=(index + 1) << 24,
            num_pages=num_pages,
            page_size=page_size,
            layer_start=layers[0],
            layer_end=layers[1],
            token_bytes=(h1 - h0) * HEAD_BYTES,
            dtype="uint8",
            head_start=h0,
            num_heads=h1 - h0,
        )
        self.buf = np.zeros(self.desc.nbytes, dtype=np.uint8)
        n = -(-TOKENS // page_size)
        self.pages = [(7 * i + 3) % num_pages for i in range(n)]
        assert len(set(self.pages)) == n

    def offset(self, token: int, layer: int, kv: int, head: int) -> int:
        d = self.desc
        page = self.pages[token // d.page_size]
        at = d.addr(page, layer, kv, token % d.page_size) - d.base_ptr
        return at + (head - d.head_start) * HEAD_BYTES

    def fill(self) -> None:
        for t, layer, kv, h in self.cells():
            at = self.offset(t, layer, kv, h)
            self.buf[at : at + HEAD_BYTES] = [value(t, layer, kv, h, b) for b in range(HEAD_BYTES)]

    def cells(self):
        d = self.desc
        return itertools.product(range(TOKENS), range(*d.layers), (0, 1), range(*d.heads))


def ranks(pp: int, tp: int, page_size: int, first: int) -> list[Pool]:
    out = []
    for i, layers in enumerate(split_layers(LAYERS, pp)):
        for t in range(tp):
            heads = (t * HEADS // tp, (t + 1) * HEADS // tp)
            out.append(Pool(first + i * tp + t, layers, heads, page_size, num_pages=16))
    return out


LAYOUTS = [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 2), (1, 2)), ((1, 2), (2, 1)),
           ((2, 1), (1, 2)), ((3, 4), (2, 2)), ((2, 4), (3, 1))]  # fmt: skip


@pytest.mark.parametrize("pages", [(4, 4), (4, 8)], ids=["same-pages", "other-pages"])
@pytest.mark.parametrize("prefill,decode", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_every_decode_rank_gets_its_heads_and_layers_exactly(prefill, decode, pages):
    src = ranks(*prefill, pages[0], first=0)
    dst = ranks(*decode, pages[1], first=100)
    for s in src:
        s.fill()
    written = {id(d): np.zeros(d.buf.size, dtype=np.int32) for d in dst}
    for s, d in itertools.product(src, dst):
        descs = build_descriptors(s.desc, d.desc, s.pages, d.pages, 0, TOKENS)
        moved = 0
        for s_at, d_at, n in descs:
            so, do = s_at - s.desc.base_ptr, d_at - d.desc.base_ptr
            assert so >= 0 and so + n <= s.buf.size, "read outside the prefill pool"
            assert do >= 0 and do + n <= d.buf.size, "write outside the decode pool"
            d.buf[do : do + n] = s.buf[so : so + n]
            written[id(d)][do : do + n] += 1
            moved += n
        layers = intersect(s.desc.layers, d.desc.layers)
        heads = intersect(s.desc.heads, d.desc.heads)
        # pools of the same heads and pages move whole pages: the last one's tail too
        whole = s.desc.heads == d.desc.heads and pages[0] == pages[1]
        tokens = -(-TOKENS // pages[0]) * pages[0] if whole else TOKENS
        want = kv_bytes(s.desc, layers, 0, tokens, 0, heads)[0] if layers and heads else 0
        assert moved == want, (s.desc, d.desc)
    for d in dst:
        for t, layer, kv, h in d.cells():
            at = d.offset(t, layer, kv, h)
            got = list(d.buf[at : at + HEAD_BYTES])
            assert got == [value(t, layer, kv, h, b) for b in range(HEAD_BYTES)], (t, layer, h)
            assert (written[id(d)][at : at + HEAD_BYTES] == 1).all(), "a byte written twice"
    assert all((w <= 1).all() for w in written.values()), "a decode byte written twice"


def test_pools_that_hold_the_same_heads_move_whole_pages():
    """Equal head ranges keep the page path: a descriptor per page run, not per token."""
    a = Pool(0, (0, 6), (0, 2), 4, 16)
    b = Pool(1, (0, 6), (0, 2), 4, 16)
    c = Pool(2, (0, 6), (0, 1), 4, 16)
    same = build_descriptors(a.desc, b.desc, a.pages, b.pages, 0, TOKENS)
    other = build_descriptors(a.desc, c.desc, a.pages, c.pages, 0, TOKENS)
    assert len(same) <= len(a.pages)
    assert len(other) == TOKENS * LAYERS * 2  # one per (token, layer, k/v): c's token is a head


def test_pools_of_other_head_sizes_are_refused():
    a = Pool(0, (0, 6), (0, 2), 4, 16)
    odd = PoolDesc(1 << 30, 16, 4, 0, 6, token_bytes=2 * 4, dtype="uint8", num_heads=2)
    with pytest.raises(ValueError, match="per token and head"):
        build_descriptors(a.desc, odd, a.pages, a.pages, 0, 4)
