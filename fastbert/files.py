"""Writing a file so that it is whole or absent: what a killed run, a full disk or a concurrent reader can see."""
from __future__ import annotations

import os
import uuid


def write_atomically(path: str, write) -> None:
    """write(temporary path) creates and fills a hidden file in the same folder (".<name>.<hex>.tmp"), which is then
    flushed to disk and renamed over `path`: a reader, or a rerun, never sees a partial file under the final name,
    and a failure leaves an existing file at `path` as it was and no temporary behind. (The temporary file is
    created by `write`, so it gets the usual permissions, not mkstemp's owner-only ones.)"""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
