"""The tokenizer of a model: a Hugging Face folder's, or a GGUF file's (cached as a folder)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pdserve.engine.model.gguf_file import gguf_cache_dir, gguf_chat_template
from pdserve.engine.model.path import ModelLoadError, describe_error, is_gguf, resolve_model


def load_tokenizer(path):
    """The transformers tokenizer of a HF folder or GGUF file, with its chat template.

    Building a tokenizer from GGUF metadata takes ~8 s on a small CPU and every process of a node
    (front and ranks) needs one, so the first load saves it as a plain tokenizer folder in the
    cache (`gguf_cache_dir`); later loads read that folder."""
    p = resolve_model(path)
    cached = _tokenizer_cache(p) if is_gguf(p) else None
    try:
        if cached is not None and (cached / "tokenizer.json").is_file():
            return _from_folder(cached)
        if is_gguf(p):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        else:
            tok = _from_folder(p)
    # transformers raises many types here (OSError, ValueError, KeyError, ...)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {p}: {describe_error(e)}") from None
    if not tok.chat_template and is_gguf(p):
        tok.chat_template = gguf_chat_template(p)
    if cached is not None:
        _save_tokenizer(tok, cached)
    return tok


# The class AutoTokenizer resolves these names to: the plain `tokenizers`-backed fast tokenizer.
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_config(folder: Path) -> dict | None:
    """The folder's tokenizer_config.json: {} when there is none, None when it cannot be read."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _from_folder(folder: Path):
    """AutoTokenizer.from_pretrained(folder), without AutoTokenizer when the folder names the plain
    fast tokenizer class: importing AutoTokenizer imports torch (~2.5 s here), which a node front
    never needs. Any other class goes through AutoTokenizer."""
    cls = (_tokenizer_config(folder) or {}).get("tokenizer_class")
    if cls in _PLAIN_FAST and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _tokenizer_cache(gguf: Path) -> Path:
    """The tokenizer folder `load_tokenizer` saves for a GGUF file (and `StopDetokenizer` reads)."""
    return gguf_cache_dir(gguf) / "tokenizer"


def _save_tokenizer(tok, dest: Path) -> None:
    """Writes into a fresh folder, then renames it into place: processes starting together may all
    write, and a reader only ever sees a complete folder.
    A cache that cannot be written is skipped."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:  # another process was first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


def saved_chat_template(path: Path) -> bool | None:
    """Whether a resolved model's saved tokenizer (a Hugging Face folder's, or the one cached for a
    GGUF file once a process loaded it) has a chat template: read from its files alone, without
    transformers. None where there is no saved tokenizer to read."""
    folder = _tokenizer_cache(path) if is_gguf(path) else path
    if (folder / "chat_template.jinja").is_file():
        return True
    if not (folder / "tokenizer_config.json").is_file():
        return None
    cfg = _tokenizer_config(folder)
    return None if cfg is None else bool(cfg.get("chat_template"))


def plain_tokenizer_json(path: Path) -> Path | None:
    """The tokenizer.json of a resolved model (a Hugging Face folder, or the tokenizer folder cached
    for a GGUF file) when the `tokenizers` library alone decodes exactly like transformers' fast
    tokenizer: there is one, and the tokenizer does not ask for the clean-up of tokenization spaces
    (an unreadable tokenizer_config.json counts as asking). None otherwise."""
    folder = _tokenizer_cache(path) if is_gguf(path) else path
    tj, cfg = folder / "tokenizer.json", _tokenizer_config(folder)
    cleanup = True if cfg is None else cfg.get("clean_up_tokenization_spaces", False)
    return tj if tj.is_file() and not cleanup else None
