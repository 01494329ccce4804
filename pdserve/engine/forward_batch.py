"""Batch metadata for one forward: token positions, KV write slots, attention groups, logit rows.

Built once per batch (Python loops over requests live here, not in the layer loop) and shared by
every layer of the slice. Token order in T: the items' new tokens concatenated in item order.

Attention runs per **group**: requests padded together into one `scaled_dot_product_attention`
call, with ONE gather per layer for K and one for V of the group's pages (whole pages, indexed by
`kv_pages`; keys past a request's length are masked). Grouping keeps padding small:

* decode items (num_new == 1) are sorted by KV length and cut into groups of DECODE_GROUP_SIZE;
  their queries are one row each (max_q == 1), the fast path. With `one_decode_group` (the
  in-place kernel, which reads each request's own pages and pads nothing) they form one group in
  item order instead; when the batch is all decode, its rows are T itself (`rows_are_t`), and the
  layer hands q and the output to the kernel with no index_select or index_copy.
* with `one_extend_group` (the in-place extend kernel, which attends each item causally over its
  own pages with no padding and no mask) the extend items form one group in item order, described
  by `first_rows` and `num_new` instead of padded query rows and a mask.
* with `one_token_group` (batch-invariant serving, engine/model/llama.py) every token of T is a
  decode query of its own over its item's keys up to its position, in one group whose rows are T:
  the decode kernel then computes a token's attention in the same order whether the token came in
  a prefill chunk or a decode step, and whatever else the batch holds.
* otherwise extend items (prefill chunks) with at least LONG_EXTEND new tokens run alone; when
  such an item starts at position 0 its attention is plain causal (`causal`, no mask, and SDPA
  skips the upper triangle). Short extend items are grouped while padding stays under 2x the real
  work.

Index arithmetic, for item b with `start` cached tokens and `num_new` new ones, query row i
(0 <= i < max_q) and key j (0 <= j < kv_len = pages * page_size):

    key j lives at pool page kv_pages[b * pages + j // page_size], offset j % page_size
    query i is token position start + i and may attend keys j <= start + i  (causal)
    rows i >= num_new are padding: they attend key 0 only (never all-masked, so never NaN),
    and their outputs are dropped (`out_sel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import pages_needed

DECODE_GROUP_SIZE = 8
EXTEND_GROUP_SIZE = 16
LONG_EXTEND = 64


@dataclass(frozen=True)
class BatchItem:
    page_table: list[int]  # pool pages of this request, in order (logical page i -> pool page)
    start: int  # tokens already in the KV cache = position of the first new token
    num_new: int  # new tokens computed this forward (>= 1)
    need_logits: bool  # whether its last new token's logits are wanted

    @property
    def kv_len(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True)
class AttnGroup:
    num_seqs: int  # Bg
    max_q: int  # query rows per request (padded); 1 for decode groups
    pages: int  # pages per request (padded); kv_len = pages * page_size
    kv_len: int
    kv_pages: torch.Tensor  # [Bg * pages] pool pages (padding: page 0, masked)
    seq_lens: torch.Tensor  # [Bg] keys of each request (kv_len before padding)
    q_rows: torch.Tensor  # [Bg * max_q] rows of T that feed the padded queries
    out_rows: torch.Tensor  # [n] rows of T that receive this group's outputs
    out_sel: torch.Tensor | None  # [n] indices into the Bg * max_q padded rows; None: all real
    mask: torch.Tensor | None  # bool [Bg, 1, max_q, kv_len], True = may attend; None: see causal
    causal: bool  # SDPA is_causal (a single request starting at position 0)
    rows_are_t: bool = False  # one query row per token of T, in order: q_rows == arange(T)
    # the in-place extend group (`one_extend_group`): row of T of each item's first new token, and
    # its new tokens; q_rows, out_rows and mask are then unused (empty, None)
    first_rows: torch.Tensor | None = None
    num_new: torch.Tensor | None = None
    # the sliding-window layers' mask (`window` > 0), bool like `mask`: also key > position -
    # window; None where the window cuts no key of the group (then `mask` and `causal` serve)
    window_mask: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    num_tokens: int  # T
    page_size: int
    positions: torch.Tensor  # [T] long
    out_slots: torch.Tensor  # [T] flat slot = page * page_size + offset
    out_pages: torch.Tensor  # [T] page of each new token
    out_offs: torch.Tensor  # [T] offset in that page
    groups: list[AttnGroup]
    logit_rows: torch.Tensor  # [n] rows of T whose logits are returned, in item order
    max_position: int
    window: int = 0  # the sliding layers' window the groups' `window_mask` holds; 0: none
    # a windowed pool's sliding layers: the same batch over their own pages (engine/window_pages.py)
    sliding: ForwardBatch | None = None


def _check_item(b: int, it: BatchItem, page_size: int) -> None:
    if it.num_new < 1 or it.start < 0:
        raise ValueError(
            f"item {b}: num_new must be >= 1 and start >= 0, got {it.num_new}, {it.start}"
        )
    need = pages_needed(it.kv_len, page_size)
    if len(it.page_table) < need:
        raise ValueError(
            f"item {b}: {it.kv_len} tokens need {need} pages, page table has {len(it.page_table)}"
        )


def build_forward_batch(
    items: list[BatchItem],
    page_size: int,
    device="cpu",
    one_decode_group: bool = False,
    one_extend_group: bool = False,
    one_token_group: bool = False,
    window: int = 0,
    masks: bool = True,
) -> ForwardBatch:
    """`one_decode_group`: the decode items in one group, in item order (the in-place decode
    kernel); `one_extend_group`: the extend items likewise (the in-place extend kernel);
    `one_token_group`: every token a decode query, in one group (the decode kernel; it overrides
    the other two). `window` > 0: the gathered groups also carry the sliding-window layers'
    masks; the decode and extend kernels take the window themselves (a one-token group too: each
    of its rows attends to the last `window` of its own keys). `masks` False: the gathered groups
    carry none (a windowed pool's sliding batch, which attends with its full batch's masks)."""
    if not items:
        raise ValueError("build_forward_batch needs at least one item")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    offsets, positions, pages_of_tok, logit_rows, row = _token_layout(items, page_size)
    pos_t = torch.tensor(positions, dtype=torch.long)
    out_pages = torch.tensor(pages_of_tok, dtype=torch.long)
    out_offs = pos_t % page_size
    groups = _attention_groups(
        items,
        offsets,
        pos_t,
        page_size,
        device,
        row,
        one_decode_group=one_decode_group,
        one_extend_group=one_extend_group,
        one_token_group=one_token_group,
        window=window,
        masks=masks,
    )
    return ForwardBatch(
        num_tokens=row,
        page_size=page_size,
        positions=pos_t.to(device),
        out_slots=(out_pages * page_size + out_offs).to(device),
        out_pages=out_pages.to(device),
        out_offs=out_offs.to(device),
        groups=groups,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        max_position=max(it.kv_len for it in items) - 1,
        window=window,
    )


def _token_layout(
    items: list[BatchItem], page_size: int
) -> tuple[list[int], list[int], list[int], list[int], int]:
    """(row of T of each item's first new token, each token's position, each token's pool page,
    logit rows, T), items checked on the way."""
    offsets: list[int] = []
    positions: list[int] = []
    pages_of_tok: list[int] = []
    logit_rows: list[int] = []
    row = 0
    for b, it in enumerate(items):
        _check_item(b, it, page_size)
        offsets.append(row)
        pos = range(it.start, it.kv_len)
        positions.extend(pos)
        pages_of_tok.extend(it.page_table[p // page_size] for p in pos)
        row += it.num_new
        if it.need_logits:
            logit_rows.append(row - 1)
    return offsets, positions, pages_of_tok, logit_rows, row


def _attention_groups(
    items: list[BatchItem],
    offsets: list[int],
    positions: torch.Tensor,
    page_size: int,
    device,
    num_tokens: int,
    *,
    one_decode_group: bool,
    one_extend_group: bool,
    one_token_group: bool,
    window: int,
    masks: bool,
) -> list[AttnGroup]:
    """The batch's attention groups (`build_forward_batch` says what the flags choose)."""
    if one_token_group:
        groups = [_build_token_group(items, positions, page_size, device)]
    else:
        groups = [
            _build_group(
                [items[b] for b in g],
                [offsets[b] for b in g],
                page_size,
                device,
                num_tokens,
                # the decode kernel takes the window itself: no mask built for its group
                0 if one_decode_group and all(items[b].num_new == 1 for b in g) else window,
                masks,
            )
            for g in _group_items(items, one_decode_group, one_extend_group)
        ]
    if one_extend_group and not one_token_group:
        extend = [b for b, it in enumerate(items) if it.num_new > 1]
        if extend:
            groups.append(
                _build_extend_group(
                    [items[b] for b in extend], [offsets[b] for b in extend], page_size, device
                )
            )
    return groups


def _group_items(
    items: list[BatchItem], one_decode_group: bool = False, one_extend_group: bool = False
) -> list[list[int]]:
    """Item indices per attention group (deterministic: a pure function of the items); with
    `one_extend_group`, the decode groups only (the extend group is built apart)."""
    if one_decode_group:
        decode = [b for b, it in enumerate(items) if it.num_new == 1]
        groups = [decode] if decode else []
    else:
        decode = sorted(
            (b for b, it in enumerate(items) if it.num_new == 1), key=lambda b: -items[b].kv_len
        )
        groups = [
            decode[i : i + DECODE_GROUP_SIZE] for i in range(0, len(decode), DECODE_GROUP_SIZE)
        ]
    if one_extend_group:
        return groups
    extend = sorted(
        (b for b, it in enumerate(items) if it.num_new > 1),
        key=lambda b: (-items[b].num_new, -items[b].kv_len),
    )
    cur: list[int] = []
    real = 0
    for b in extend:
        it = items[b]
        if it.num_new >= LONG_EXTEND:
            groups.append([b])
            continue
        cost = it.num_new * it.kv_len
        if cur:  # sorted by num_new, so the group's max_q is its first item's
            padded = (
                (len(cur) + 1) * items[cur[0]].num_new * max(items[c].kv_len for c in cur + [b])
            )
            if len(cur) >= EXTEND_GROUP_SIZE or padded > 2 * (real + cost):
                groups.append(cur)
                cur, real = [], 0
        cur.append(b)
        real += cost
    if cur:
        groups.append(cur)
    return groups


def _page_table(items: list[BatchItem], page_size: int) -> torch.Tensor:
    """[len(items), pages] pool pages of each item's keys; padding: page 0 (never read unmasked)."""
    pages = max(pages_needed(it.kv_len, page_size) for it in items)
    table = torch.zeros(len(items), pages, dtype=torch.long)
    for r, it in enumerate(items):
        need = pages_needed(it.kv_len, page_size)
        table[r, :need] = torch.tensor(it.page_table[:need], dtype=torch.long)
    return table


def _build_token_group(
    items: list[BatchItem], positions: torch.Tensor, page_size: int, device
) -> AttnGroup:
    """Every token of T a one-row decode query: its item's pages, keys up to its own position."""
    table = _page_table(items, page_size)
    num_new = torch.tensor([it.num_new for it in items], dtype=torch.long)
    tokens = positions.numel()
    rows = torch.arange(tokens, dtype=torch.long, device=device)
    return AttnGroup(
        num_seqs=tokens,
        max_q=1,
        pages=table.shape[1],
        kv_len=table.shape[1] * page_size,
        kv_pages=table.repeat_interleave(num_new, dim=0).flatten().to(device),
        seq_lens=(positions + 1).to(device),
        q_rows=rows,
        out_rows=rows,
        out_sel=None,
        mask=None,
        causal=False,
        rows_are_t=True,
    )


def _build_extend_group(
    items: list[BatchItem], offsets: list[int], page_size: int, device
) -> AttnGroup:
    kv_pages = _page_table(items, page_size)
    pages = kv_pages.shape[1]
    none = torch.empty(0, dtype=torch.long, device=device)
    return AttnGroup(
        num_seqs=len(items),
        max_q=max(it.num_new for it in items),
        pages=pages,
        kv_len=pages * page_size,
        kv_pages=kv_pages.flatten().to(device),
        seq_lens=torch.tensor([it.kv_len for it in items], dtype=torch.long, device=device),
        q_rows=none,
        out_rows=none,
        out_sel=None,
        mask=None,
        causal=False,
        first_rows=torch.tensor(offsets, dtype=torch.long, device=device),
        num_new=torch.tensor([it.num_new for it in items], dtype=torch.long, device=device),
    )


def _build_group(
    items: list[BatchItem],
    offsets: list[int],
    page_size: int,
    device,
    num_tokens: int,
    window: int = 0,
    masks: bool = True,
) -> AttnGroup:
    bg = len(items)
    max_q = max(it.num_new for it in items)
    kv_pages = _page_table(items, page_size)
    pages = kv_pages.shape[1]
    kv_len = pages * page_size
    off = torch.tensor(offsets, dtype=torch.long)
    num_new = torch.tensor([it.num_new for it in items], dtype=torch.long)
    q_idx = torch.arange(max_q)
    real = q_idx[None, :] < num_new[:, None]  # [Bg, max_q]
    q_rows = off[:, None] + torch.minimum(
        q_idx[None, :], num_new[:, None] - 1
    )  # padding repeats last row
    out_sel = real.flatten().nonzero().squeeze(1)
    out_rows = q_rows.flatten()[out_sel]
    all_real = bool(real.all())
    causal = bg == 1 and items[0].start == 0 and max_q > 1
    start = torch.tensor([it.start for it in items], dtype=torch.long)
    key = torch.arange(kv_len)
    pos = start[:, None] + q_idx[None, :]  # [Bg, max_q] each query row's position
    mask = None
    if not causal and masks:
        mask = key[None, None, :] <= pos[:, :, None]  # [Bg, max_q, kv_len]
        if not all_real:
            mask = torch.where(real[:, :, None], mask, key[None, None, :] == 0)
        mask = None if bool(mask.all()) else mask[:, None].to(device)
    window_mask = None
    # a window cuts keys only for positions at or past it (key > position - window for all keys
    # from 0 up otherwise)
    if masks and window and max(it.kv_len for it in items) > window:
        seen = (key[None, None, :] <= pos[:, :, None]) & (
            key[None, None, :] > pos[:, :, None] - window
        )
        seen = torch.where(real[:, :, None], seen, key[None, None, :] == 0)
        window_mask = seen[:, None].to(device)
    return AttnGroup(
        num_seqs=bg,
        max_q=max_q,
        pages=pages,
        kv_len=kv_len,
        kv_pages=kv_pages.flatten().to(device),
        seq_lens=torch.tensor([it.kv_len for it in items], dtype=torch.long, device=device),
        q_rows=q_rows.flatten().to(device),
        out_rows=out_rows.to(device),
        out_sel=None if all_real else out_sel.to(device),
        mask=mask,
        causal=causal,
        rows_are_t=max_q == 1 and offsets == list(range(num_tokens)),
        window_mask=window_mask,
    )
