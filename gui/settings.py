"""User settings: QSettings in an INI file under the platformdirs config folder.

The file lives in ``engine.paths.config_dir()`` rather than Qt's native store (the
Windows registry) so that ``CHECKPOINT_CHAT_HOME`` relocates it for tests and portable
installs, and so a user can read and back it up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QSettings

from engine import paths
from engine.checkpoints import graph
from engine.sampling import SamplerSettings, random_seed


@dataclass(frozen=True)
class _Key:
    name: str
    default: object
    kind: type


_KEYS = {k.name: k for k in (
    _Key("model_path", "", str),
    _Key("llama_lib", "", str),
    _Key("n_gpu_layers", 0, int),
    _Key("rpc_servers", "", str),        # remote workers "host:port, ..." (README: More than one machine)
    _Key("n_ctx", 4096, int),
    _Key("n_threads", 0, int),
    _Key("sequences", 4, int),           # conversations resident in the cache, answers at once
    # the sampler: None (unset) means the loaded model's own default (engine.sampling)
    _Key("temperature", None, float),
    _Key("top_k", None, int),
    _Key("top_p", None, float),
    _Key("min_p", None, float),
    _Key("repeat_penalty", None, float),
    _Key("seed", -1, int),               # -1: a fresh random seed per conversation
    _Key("n_predict", -1, int),          # answer length limit (-1: none)
    _Key("system_prompt", "", str),
    _Key("autosave_every", 64, int),     # tokens; 0 turns autosave off
    _Key("checkpoint_dir", "", str),
    _Key("autosave_budget_mb", graph.DEFAULT_BUDGET_BYTES >> 20, int),   # superseded files (MB)
    _Key("local_server", 0, int),        # 1: serve the OpenAI-compatible API (gui.local_server)
    _Key("local_server_port", 8080, int),
)}

MAX_RECENT_MODELS = 8
#: limits whose 0 means none, read as -1 (an answer limit of 0 gave empty answers, said
#: nowhere: typed in the Settings dialog as "none", under Wine); the dialog shows 0 as "none"
NONE_AT_ZERO = frozenset({"n_predict"})
#: Settings that default to the loaded model's own recommendation.
SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")


class AppSettings:
    """Typed access to the settings file; attribute names are the keys above."""

    def __init__(self, path: Path | None = None) -> None:
        path = path or paths.config_dir() / "settings.ini"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.qsettings = QSettings(str(path), QSettings.Format.IniFormat)

    def __getattr__(self, name: str):
        key = _KEYS.get(name)
        if key is None:
            raise AttributeError(name)
        value = self.qsettings.value(name, key.default)
        if value is None:
            return None
        try:
            value = key.kind(value)
        except (TypeError, ValueError):
            return key.default
        return -1 if name in NONE_AT_ZERO and value == 0 else value

    def __setattr__(self, name: str, value) -> None:
        if name in _KEYS:
            if value is None:
                self.qsettings.remove(name)      # back to the default (the model's, for the sampler)
            else:
                self.qsettings.setValue(name, _KEYS[name].kind(value))
        else:
            super().__setattr__(name, value)

    def sync(self) -> None:
        self.qsettings.sync()

    # -- derived values -------------------------------------------------------------------
    def checkpoint_folder(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else paths.checkpoint_dir()

    def sampler(self, defaults: SamplerSettings | None = None) -> SamplerSettings:
        """The sampler for a new conversation: what the user set, else ``defaults`` (the
        loaded model's, see engine.sampling)."""
        base = defaults or SamplerSettings()
        seed = self.seed
        changes = {name: getattr(self, name) for name in SAMPLER_KEYS if getattr(self, name) is not None}
        return replace(base, **changes, seed=random_seed() if seed < 0 else seed)

    def recent_models(self) -> list[str]:
        value = self.qsettings.value("recent_models", [])
        if isinstance(value, str):
            value = [value]
        return [str(v) for v in (value or []) if v]

    def add_recent_model(self, path: str) -> None:
        recent = [path] + [p for p in self.recent_models() if p != path]
        self.qsettings.setValue("recent_models", recent[:MAX_RECENT_MODELS])


def default_of(name: str):
    return _KEYS[name].default
