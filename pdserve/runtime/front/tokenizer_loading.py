"""A node front's tokenizer, loaded in a thread while the node starts its ranks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class TokenizerLoading:
    """The front's tokenizer, loading in a thread while the node starts its ranks: the ranks'
    start-up (mostly importing torch) and the tokenizer's (importing transformers, reading the
    files) overlap instead of running one after the other. Any use waits for the load."""

    def __init__(self, path):
        from pdserve.engine.model.tokenizer import load_tokenizer

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
        self._future = self._pool.submit(load_tokenizer, path)
        self._pool.shutdown(wait=False)

    def ready(self):
        return self._future.result()

    def __getattr__(self, name):
        return getattr(self._future.result(), name)

    def __call__(self, *args, **kwargs):
        return self._future.result()(*args, **kwargs)
