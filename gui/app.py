"""Desktop app entry point."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("the desktop app is not built yet; use `checkpoint-chat run --prompt ...`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
