"""Each attention group's masks for one forward, made once and shared by every layer of the slice:
apart from llama.py so the slice's forward reads as its layer loop."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model.decoder_layer import EXTEND_IN_PLACE, IN_PLACE


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: may attend) as SDPA's additive one, in `dtype`."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def group_masks(
    fb: ForwardBatch, in_place: bool, window: int, dtype: torch.dtype
) -> tuple[list, list]:
    """(full layers' masks, sliding layers' masks), one entry per group of `fb`: IN_PLACE or
    EXTEND_IN_PLACE where a kernel serves the group, else None (no mask) or an additive mask.
    `in_place`: decode groups attend with the in-place kernel; `window`: the slice's sliding
    layers' window (0: none)."""
    # SDPA would turn a bool mask into an additive one on every call: do it once per forward.
    masks = [
        EXTEND_IN_PLACE
        if g.first_rows is not None
        else IN_PLACE
        if in_place and g.max_q == 1
        else None
        if g.mask is None
        else additive(g.mask, dtype)
        for g in fb.groups
    ]
    # the sliding layers' (Gemma 3): where a group's window cuts no key, its plain mask
    # (a group a kernel serves keeps it: the decode kernel is given the window). A decode
    # group built for the kernel carries no window mask, so it must not be gathered.
    if (
        window
        and not in_place
        and any(
            g.window_mask is None and g.max_q == 1 and int(g.seq_lens.max()) > window
            for g in fb.groups
        )
    ):
        raise ValueError("a decode group built for the kernel, which this slice does not use")
    window_masks = [
        additive(g.window_mask, dtype)
        if g.window_mask is not None and (m is None or torch.is_tensor(m))
        else m
        for g, m in zip(fb.groups, masks, strict=True)
    ]
    return masks, window_masks
