"""Files written so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes JSON so that a reader sees either the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
