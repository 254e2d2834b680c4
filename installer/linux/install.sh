#!/usr/bin/env bash
# Register Checkpoint Chat with the desktop (per user): menu entry, the
# application/x-kvckpt type, and Checkpoint Chat as the default for it.
# Needs xdg-utils and shared-mime-info; `checkpoint-chat-gui` must be on PATH
# (pip install puts it in the environment's bin folder).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
xdg-mime install --novendor "$HERE/checkpoint-chat-mime.xml"
xdg-desktop-menu install --novendor "$HERE/checkpoint-chat.desktop"
xdg-mime default checkpoint-chat.desktop application/x-kvckpt
echo "registered: .kvckpt files now open in Checkpoint Chat"
