"""The files dropbp writes and reads: written whole or not at all, read with an error that names the file.

A crash mid-write leaves the old file or the new one, never half of one (:func:`write_atomically`); a file that
does not parse is refused naming its path and what to do (:func:`read_json`).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_atomically"]


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path``: into a temporary file beside it, flushed to disk, then renamed over it. The
    temporary name is the writer's own (process, thread and a random part), so concurrent writers never share one:
    the file ends holding one writer's whole text."""
    temporary = f"{os.fspath(path)}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def read_json(path: str | os.PathLike[str], remedy: str) -> Any:
    """The JSON in ``path``; a file that does not parse raises ``ValueError`` naming the path, then ``remedy``."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"dropbp: {os.fspath(path)} is not valid JSON ({error}): the file is damaged (cut short by a crash "
            f"while it was written, or edited); {remedy}"
        ) from None
