"""Writing files atomically: a temporary file in the same folder, then renamed over the target.

An interrupt or a full disk never leaves a partial file; a write error is one :class:`ShardplanError` line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from shardplan.errors import ShardplanError

__all__ = ["write_file", "write_text"]


def write_file(path: str, fill: Callable[[str], None]) -> None:
    """Have ``fill(name)`` write the file ``path`` atomically: it writes a temporary file in the same folder
    (with ``path``'s suffix, so a writer that picks its format by the name picks the same one), then that is
    renamed over ``path``, so an interrupt or a full disk never leaves a partial file; an error is one line.

    A ``path`` that exists and is not a regular file (``/dev/stdout``, ``/dev/full``, a named pipe) is written
    in place: renaming over it would replace the device or pipe with a file."""
    target = Path(path)
    tmp = None
    try:
        if target.exists() and not target.is_file():
            fill(str(target))
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=target.parent)
        os.close(fd)
        fill(tmp)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise ShardplanError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`write_file`); an error is one line."""

    def fill(name: str) -> None:
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)

    write_file(path, fill)
