"""The engine: sessions, generation, checkpoints and the CLI.  Pure Python, never Qt."""

APP_VERSION = "0.1.0"
