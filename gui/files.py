"""Small helpers for files in the window: dropped URLs and human-readable sizes."""

from __future__ import annotations

from pathlib import Path


def local_checkpoint_paths(urls) -> list[Path]:
    """Local files among dropped URLs (folders and remote URLs are ignored)."""
    out = []
    for url in urls:
        if url.isLocalFile():
            p = Path(url.toLocalFile())
            if p.is_file():
                out.append(p)
    return out


def file_size_text(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"
