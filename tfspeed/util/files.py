"""Files written so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
from typing import Any


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` under a temporary name, syncs it and renames it into place: a reader
    sees either the old file or the whole new one, also after a crash."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes JSON so that a reader sees either the old file or the whole new one."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())
