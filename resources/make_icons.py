"""Render resources/checkpoint-chat.svg into the icon files the app and installers use.

    python resources/make_icons.py [OUT_DIR]

Writes, into OUT_DIR (default: this folder):

* ``checkpoint-chat.ico``: the Windows icon (executables, the window, the .kvckpt file
  type, Setup.exe).  Sizes 16, 20, 24, 32, 40, 48 and 64 are 32-bit BGRA bitmaps with
  an all-zero AND mask (alpha decides), which every Windows tool reads; 256 is stored
  as PNG, as Windows Vista introduced for that size.
* ``icons/checkpoint-chat-N.png`` for N in 16, 24, 32, 48, 64, 128, 256: the window
  icon on every platform, and the Linux desktop entry's icon (installer/linux/install.sh).

The ICO layout (all little-endian): ICONDIR (reserved 0, type 1, count), then one
16-byte ICONDIRENTRY per image (width and height, 0 meaning 256; colours 0; reserved 0;
planes 1; bits 32; byte size; offset), then the images.  A bitmap image is a
BITMAPINFOHEADER whose height counts the colour rows and the mask rows (2 x size),
the pixels bottom-up, then the 1-bit mask, rows padded to 4 bytes.

Uses Qt's SVG renderer (PySide6, already a dependency): no other tool is needed.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "checkpoint-chat.svg"
ICO_NAME = "checkpoint-chat.ico"
ICO_SIZES = (16, 20, 24, 32, 40, 48, 64, 256)
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256)


def png_name(size: int) -> str:
    return f"icons/checkpoint-chat-{size}.png"


def render(size: int, source: Path = SOURCE):
    """The SVG drawn at ``size`` x ``size``, as a QImage in straight (not premultiplied) ARGB."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(source))
    if not renderer.isValid():
        raise SystemExit(f"cannot read {source}")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    return image.convertToFormat(QImage.Format.Format_ARGB32)


def png_bytes(image) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def dib_bytes(image) -> bytes:
    """A 32-bit BGRA bitmap with its AND mask, as an ICO image entry holds it."""
    size = image.width()
    # Format_ARGB32 is 0xAARRGGBB per pixel: B, G, R, A in memory on little-endian
    rows = [bytes(image.constScanLine(y))[:4 * size] for y in range(size)]
    header = struct.pack("<IiiHHIIiiII", 40, size, 2 * size, 1, 32, 0, 0, 0, 0, 0, 0)
    mask_row = bytes(((size + 31) // 32) * 4)
    return header + b"".join(reversed(rows)) + mask_row * size


def ico_bytes(images: dict[int, bytes]) -> bytes:
    """An ICO file holding ``images`` ({size: encoded image}), smallest first."""
    sizes = sorted(images)
    out = struct.pack("<HHH", 0, 1, len(sizes))
    offset = 6 + 16 * len(sizes)
    for size in sizes:
        edge = 0 if size >= 256 else size
        out += struct.pack("<BBBBHHII", edge, edge, 0, 0, 1, 32, len(images[size]), offset)
        offset += len(images[size])
    return out + b"".join(images[s] for s in sizes)


def make(out_dir: Path = HERE, source: Path = SOURCE) -> list[Path]:
    from PySide6.QtGui import QGuiApplication
    app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841 - Qt needs one
    written = []
    entries = {}
    for size in ICO_SIZES:
        image = render(size, source)
        entries[size] = png_bytes(image) if size >= 256 else dib_bytes(image)
    ico = out_dir / ICO_NAME
    ico.write_bytes(ico_bytes(entries))
    written.append(ico)
    for size in PNG_SIZES:
        path = out_dir / png_name(size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png_bytes(render(size, source)))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in make(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
