"""Where Checkpoint Chat keeps its files (platformdirs), overridable for tests."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "CheckpointChat"
#: Set to a folder to relocate every user file (tests, portable installs).
HOME_ENV_VAR = "CHECKPOINT_CHAT_HOME"


def _root(kind: str) -> Path:
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        return Path(override) / kind
    dirs = platformdirs.PlatformDirs(APP_NAME, appauthor=False)
    return Path({"data": dirs.user_data_dir, "cache": dirs.user_cache_dir,
                 "log": dirs.user_log_dir, "config": dirs.user_config_dir}[kind])


def data_dir() -> Path:
    return _root("data")


def checkpoint_dir() -> Path:
    """The default checkpoint store."""
    return data_dir() / "checkpoints"


def cache_dir() -> Path:
    return _root("cache")


def log_dir() -> Path:
    return _root("log")


def config_dir() -> Path:
    return _root("config")
