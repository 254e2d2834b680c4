#!/usr/bin/env bash
# Register Checkpoint Chat with the desktop (per user): menu entry, the icon, the
# application/x-kvckpt type, and Checkpoint Chat as the default for it.
# Needs xdg-utils and shared-mime-info; `checkpoint-chat-gui` must be on PATH
# (pip install puts it in the environment's bin folder).  Run from a checkout: the
# icon comes from ../../resources/icons (made by resources/make_icons.py).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ICONS="$HERE/../../resources/icons"
for size in 16 24 32 48 64 128 256; do
    # the app's icon, and the same picture for its file type (the name the MIME type asks for)
    xdg-icon-resource install --noupdate --novendor --context apps --size "$size" \
        "$ICONS/checkpoint-chat-$size.png" checkpoint-chat
    xdg-icon-resource install --noupdate --novendor --context mimetypes --size "$size" \
        "$ICONS/checkpoint-chat-$size.png" application-x-kvckpt
done
xdg-icon-resource forceupdate
xdg-mime install --novendor "$HERE/checkpoint-chat-mime.xml"
xdg-desktop-menu install --novendor "$HERE/checkpoint-chat.desktop"
xdg-mime default checkpoint-chat.desktop application/x-kvckpt
echo "registered: .kvckpt files now open in Checkpoint Chat"
