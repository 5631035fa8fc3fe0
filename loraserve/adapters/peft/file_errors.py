"""What an OSError while reading an adapter means to whoever asked for the load.

A path the client got wrong (too long, not a directory, unreadable) is the client's mistake:
400. A file that was there a moment ago and is gone now (or was swapped) is the operator's
files changing underneath the load: 409, retry when they are in place. Anything else the disk
says (I/O error, no memory for a buffer) is the server's trouble: 503 with Retry-After.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from loraserve.types import AdapterFilesChangedError, AdapterFormatError, LoraServeError

_CLIENT = {errno.ENAMETOOLONG: "the path is too long", errno.ENOTDIR: "a path part is not a "
           "directory", errno.ELOOP: "too many levels of symbolic links",
           errno.EISDIR: "a directory where a file was expected",
           errno.EACCES: "the server may not read it", errno.EPERM: "the server may not read it",
           errno.EINVAL: "the path is invalid"}
_CHANGED = (errno.ENOENT, errno.ESTALE)


class AdapterStorageError(LoraServeError):
    status = 503
    code = "server_unavailable"
    retry_after_s = 5


@contextmanager
def os_errors_as_load_errors(path: object) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        if e.errno in _CLIENT:
            raise AdapterFormatError(f"adapter {path}: cannot read it: {_CLIENT[e.errno]}"
                                     f"{where}") from None
        if e.errno in _CHANGED:
            raise AdapterFilesChangedError(
                f"adapter {path}: a file vanished while the adapter was being read{where}; "
                "the files changed on disk during the load: retry when they are in place"
            ) from None
        raise AdapterStorageError(f"adapter {path}: the disk failed while reading it: "
                                  f"{e.strerror or e}{where}") from None
    except ValueError as e:  # a path with a NUL byte
        if "null" in str(e) or "embedded" in str(e):
            raise AdapterFormatError(f"adapter {path}: the path is invalid") from None
        raise
