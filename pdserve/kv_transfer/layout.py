"""Which bytes move where: layer-slice mapping and transfer descriptors (pure functions).

A rank's KV pool is `kv[page, local_layer, k_or_v, token_in_page, kv_head, head_dim]` (the engine's
KVLayout, docs/ARCHITECTURE.md section 6), described here as plain data by `PoolDesc`. Byte offsets:

    addr(page, layer, kv, t) = base + page * page_bytes + (layer - layer_start) * layer_bytes
                                    + kv * page_size * token_bytes + t * token_bytes
    layer_bytes = 2 * page_size * token_bytes        page_bytes = num_layers * layer_bytes

so inside one page any contiguous run of layers is one contiguous byte range, and consecutive pages
with the same layer slice on both sides are one range too.

Page tables: `page_ids[i]` is the page holding tokens [i * page_size, (i + 1) * page_size) of the
request, on either side. A decode table may start later (`dst_first_page`): a decode rank that holds
the first pages of the prompt in its prefix cache registers only the pages after them, so no
descriptor can name a cached page.

KV heads: under tensor parallelism (docs/ARCHITECTURE.md section 15) a pool holds the model's KV
heads [head_start, head_start + num_heads) only, each token's heads side by side (`head_bytes`
each). Two pools that hold the same heads move as above; pools of different TP sizes move the
heads both hold, one descriptor per (layer, k/v, token), so no rank receives a head it does not
hold. A pool that says nothing of heads (`num_heads` 1) is one unit of the whole token.

Sliding windows (a model with `window` > 0, its `sliding` layers): decode never reads a sliding
layer's keys more than `window` positions back, so those layers move only the tokens from
`window_start(prompt tokens, window, decode page size)` on, and a page wholly before it moves only
its full-attention layers. Both sides compute the same `window_start`.

A buffer may hold only some layers of its slice (`held`, in order; `layer_bytes` apart): a
windowed decode pool is two buffers, its full-attention layers' and its sliding layers', each with
its own page table (kv_transfer/targets.py); a slice of sliding layers only has a full buffer of
no bytes. Descriptors move the layers both sides hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

Desc = tuple[int, int, int]  # (source address, destination address, length in bytes)

LAYOUT_NAME = "page:layer:kv:token"  # the only pool layout this package moves


@dataclass(frozen=True)
class PoolDesc:
    """One rank's KV pool as plain data (mirrors engine.kv_cache.KVLayout plus the base pointer)."""

    base_ptr: int
    num_pages: int
    page_size: int
    layer_start: int
    layer_end: int
    token_bytes: int  # one token's K (or V) of one layer: kv_heads * head_dim * element size
    dtype: str
    window: int = 0  # the model's sliding window in positions (0: none)
    sliding: tuple[int, ...] = ()  # this slice's layers that slide (global indices, ascending)
    head_start: int = 0  # the first of the model's KV heads this pool holds
    num_heads: int = 1  # KV heads it holds; token_bytes is num_heads * head_bytes
    held: tuple[int, ...] | None = None  # the slice's layers this buffer holds (None: all)

    def __post_init__(self):
        if not (0 <= self.layer_start < self.layer_end):
            raise ValueError(f"bad layer slice [{self.layer_start}, {self.layer_end})")
        if self.num_pages < 1 or self.page_size < 1 or self.token_bytes < 1 or self.base_ptr < 0:
            raise ValueError(f"bad pool geometry {self}")
        if self.head_start < 0 or self.num_heads < 1 or self.token_bytes % self.num_heads:
            raise ValueError(f"bad heads: {self.num_heads} from {self.head_start} in {self}")
        object.__setattr__(self, "sliding", tuple(self.sliding))
        if self.window < 0 or (self.sliding and not self.window):
            raise ValueError(f"bad window {self.window} for sliding layers {self.sliding}")
        if list(self.sliding) != sorted(set(self.sliding)) or not all(
            self.layer_start <= x < self.layer_end for x in self.sliding
        ):
            raise ValueError(
                f"sliding layers {self.sliding} not in [{self.layer_start}, "
                f"{self.layer_end}) in order"
            )
        held = self.holds
        if list(held) != sorted(set(held)) or not all(
            self.layers[0] <= x < self.layers[1] for x in held
        ):
            raise ValueError(f"held layers {self.held} not in {self.layers} in order")

    @cached_property
    def holds(self) -> tuple[int, ...]:
        """The global layers this buffer holds, in its order."""
        if self.held is None:
            return tuple(range(self.layer_start, self.layer_end))
        return tuple(self.held)

    @cached_property
    def _index(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.holds)}

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_end)

    @property
    def heads(self) -> tuple[int, int]:
        return (self.head_start, self.head_start + self.num_heads)

    @property
    def head_bytes(self) -> int:
        return self.token_bytes // self.num_heads

    @property
    def layer_bytes(self) -> int:
        return 2 * self.page_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        return len(self.holds) * self.layer_bytes

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def addr(self, page: int, layer: int, kv: int = 0, token: int = 0) -> int:
        return (
            self.base_ptr
            + page * self.page_bytes
            + self._index[layer] * self.layer_bytes
            + kv * self.page_size * self.token_bytes
            + token * self.token_bytes
        )

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: Mapping) -> PoolDesc:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def overlapping(
    mine: tuple[int, int], others: Mapping[int, tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """(rank, lo, hi) for every rank of `others` whose slice intersects `mine`, by rank."""
    out = []
    for rank in sorted(others):
        inter = intersect(mine, others[rank])
        if inter is not None:
            out.append((rank, inter[0], inter[1]))
    return out


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def window_start(num_tokens: int, window: int, page_size: int) -> int:
    """The first token a sliding layer moves for a prompt of `num_tokens` (0: all of them): the
    first decode step, at position `num_tokens`, reads keys from `num_tokens - window + 1` on;
    one more is kept, and the start is rounded down to a decode page, so that every decode page
    either has its sliding layers' KV whole or has none of it (engine/prefix_cache.py)."""
    if window <= 0:
        return 0
    return max(0, num_tokens - window) // page_size * page_size


def check_compatible(src: PoolDesc, dst: PoolDesc) -> None:
    if src.head_bytes != dst.head_bytes or src.dtype != dst.dtype:
        raise ValueError(
            f"KV formats differ: prefill {src.dtype}/{src.head_bytes} B per token and head, "
            f"decode {dst.dtype}/{dst.head_bytes} B per token and head"
        )
    shared = intersect(src.layers, dst.layers)
    if shared is not None and (
        src.window != dst.window
        or [x for x in src.sliding if shared[0] <= x < shared[1]]
        != [x for x in dst.sliding if shared[0] <= x < shared[1]]
    ):
        raise ValueError(
            f"sliding windows differ: prefill {src.window} on {src.sliding}, decode "
            f"{dst.window} on {dst.sliding}"
        )


def shared_layers(src: PoolDesc, dst: PoolDesc) -> list[int]:
    """The layers both buffers hold, ascending."""
    both = intersect(src.layers, dst.layers)
    if both is None:
        return []
    return [x for x in range(*both) if x in src._index and x in dst._index]


def layer_runs(layers: Sequence[int], skip: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """The runs [a, b) of consecutive layers of `layers` (ascending) that are not in `skip`: each
    is one byte range of a page on both sides, as both hold every layer of it, in order."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if layer in skip:
            continue
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def _check_table(
    pool: PoolDesc, page_ids: Sequence[int], num_tokens: int, side: str, first_page: int = 0
) -> None:
    need = pages_for(num_tokens, pool.page_size) - first_page
    if len(page_ids) < need:
        raise ValueError(
            f"{side} page table has {len(page_ids)} pages, {need} needed for {num_tokens} tokens"
        )
    for p in page_ids[:need]:
        if not 0 <= p < pool.num_pages:
            raise ValueError(f"{side} page id {p} outside the pool of {pool.num_pages} pages")


def build_descriptors(
    src: PoolDesc,
    dst: PoolDesc,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    token_start: int,
    token_end: int,
    dst_first_page: int = 0,
    slide_from: int = 0,
) -> list[Desc]:
    """Descriptors moving tokens [token_start, token_end) of the layers both pools hold, and of
    the sliding layers only those from `slide_from` on (a multiple of the decode page size:
    `window_start`).

    `dst_pages[0]` is the decode page `dst_first_page` of the request (the pages before it are the
    decode rank's cached prefix); a range starting before that page is refused.

    Equal page sizes: whole pages move (the chunk's range rounded out to page boundaries; the bytes
    before `token_start` in the first page were already valid, those after `token_end` in the last
    page are overwritten by later chunks or by decode itself), one descriptor per page for the
    shared layer run, then merged across pages where both sides are consecutive. Different page
    sizes: one descriptor per (layer, k/v, token run inside one page on both sides).
    """
    check_compatible(src, dst)
    layers = shared_layers(src, dst)
    heads = intersect(src.heads, dst.heads)
    if not layers or heads is None or token_end <= token_start:
        return []
    if token_start < dst_first_page * dst.page_size or dst_first_page < 0:
        raise ValueError(
            f"bad token range [{token_start}, {token_end}) for a decode table from page "
            f"{dst_first_page}"
        )
    _check_table(src, src_pages, token_end, "prefill")
    _check_table(dst, dst_pages, token_end, "decode", dst_first_page)
    if slide_from % dst.page_size or slide_from < 0:
        raise ValueError(f"sliding layers from token {slide_from}: not a decode page boundary")
    dst_pages = [-1] * dst_first_page + list(dst_pages)  # never read below dst_first_page
    sliding = tuple(x for x in src.sliding if x in layers) if slide_from else ()
    args = (src, dst, src_pages, dst_pages, (token_start, token_end), layers, sliding, slide_from)
    if src.heads != dst.heads:  # TP sizes differ: the heads both hold, token by token
        return coalesce(_head_descs(*args, heads))
    return coalesce(_page_descs(*args) if src.page_size == dst.page_size else _run_descs(*args))


def _page_descs(
    src: PoolDesc,
    dst: PoolDesc,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    tokens: tuple[int, int],
    layers: list[int],
    sliding: tuple[int, ...],
    slide_from: int,
) -> list[Desc]:
    """Equal page sizes: one descriptor per whole page for the shared layers (its full-attention
    runs only, for a page wholly before `slide_from`); `build_descriptors` checked the tables."""
    token_start, token_end = tokens
    every, full_only = layer_runs(layers), layer_runs(layers, sliding)
    out: list[Desc] = []
    ps = src.page_size
    for i in range(token_start // ps, pages_for(token_end, ps)):
        for a, b in every if (i + 1) * ps > slide_from else full_only:
            src_at, dst_at = src.addr(src_pages[i], a), dst.addr(dst_pages[i], a)
            out.append((src_at, dst_at, (b - a) * src.layer_bytes))
    return out


def _run_descs(
    src: PoolDesc,
    dst: PoolDesc,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    tokens: tuple[int, int],
    layers: list[int],
    sliding: tuple[int, ...],
    slide_from: int,
) -> list[Desc]:
    """Different page sizes: one descriptor per (layer, k/v, token run inside one page on both
    sides); `build_descriptors` checked the tables."""
    token_start, token_end = tokens
    out: list[Desc] = []
    tb = src.token_bytes
    t = token_start
    while t < token_end:
        s_page, s_off = divmod(t, src.page_size)
        d_page, d_off = divmod(t, dst.page_size)
        u = min(token_end, t + src.page_size - s_off, t + dst.page_size - d_off)
        for layer in layers:
            if layer in sliding and u <= slide_from:  # a run never straddles it (a decode page)
                continue
            for kv in (0, 1):
                out.append(
                    (
                        src.addr(src_pages[s_page], layer, kv, s_off),
                        dst.addr(dst_pages[d_page], layer, kv, d_off),
                        (u - t) * tb,
                    )
                )
        t = u
    return out


def _head_descs(
    src: PoolDesc,
    dst: PoolDesc,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    tokens: tuple[int, int],
    layers: list[int],
    sliding: tuple[int, ...],
    slide_from: int,
    heads: tuple[int, int],
) -> list[Desc]:
    """Pools of different head ranges: one descriptor per (layer, k/v, token) for the heads both
    hold, where they sit in each side's token (`coalesce` joins what follows on); the sliding
    layers from `slide_from` on. `build_descriptors` checked the tables."""
    (token_start, token_end), (h0, h1) = tokens, heads
    n = (h1 - h0) * src.head_bytes
    s_head, d_head = (h0 - src.head_start) * src.head_bytes, (h0 - dst.head_start) * dst.head_bytes
    out: list[Desc] = []
    for t in range(token_start, token_end):
        s_page, s_off = divmod(t, src.page_size)
        d_page, d_off = divmod(t, dst.page_size)
        for layer in layers:
            if layer in sliding and t < slide_from:
                continue
            for kv in (0, 1):
                s_at = src.addr(src_pages[s_page], layer, kv, s_off) + s_head
                out.append((s_at, dst.addr(dst_pages[d_page], layer, kv, d_off) + d_head, n))
    return out


def chunk_descriptors(
    src: PoolDesc,
    dst: PoolDesc,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    chunk: tuple[int, int],
    prefix_tokens: int,
    total_tokens: int,
) -> list[Desc]:
    """A sender's descriptors for tokens [chunk) to a decode rank that holds the first
    `prefix_tokens` (its table starts after them), of a transfer of `total_tokens` in all."""
    return build_descriptors(
        src,
        dst,
        src_pages,
        dst_pages,
        max(chunk[0], prefix_tokens),
        chunk[1],
        prefix_tokens // dst.page_size,
        window_start(total_tokens, dst.window, dst.page_size),
    )


def coalesce(descs: Iterable[Desc]) -> list[Desc]:
    """Merges each descriptor into the previous one when its source and destination follow on."""
    out: list[Desc] = []
    for s, d, n in descs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            ps, pd, pn = out[-1]
            out[-1] = (ps, pd, pn + n)
        else:
            out.append((s, d, n))
    return out
