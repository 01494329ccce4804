"""transformers' greedy answers (tests/reference.py) on one torch thread, as conftest.py's
`tiny6_greedy` computes them: for the tiny test models, several times faster than on every core of
a busy machine."""

from __future__ import annotations

import contextlib

import torch
from reference import hf_greedy, load_hf


@contextlib.contextmanager
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hf_greedy_one_thread(model_path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    with one_torch_thread():
        return hf_greedy(load_hf(model_path), prompts, max_new)
