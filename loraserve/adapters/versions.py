"""Adapter versions: which uid each `name` and `name@N` means.

Every successful load of a name is a new version (1, 2, 3, ... per name, never reused, also
after an unload), with a uid of its own. `name` means the newest live version, `name@N`
version N while it is live. A request resolves the name once, at admission, and keeps the uid
it got: a later load never changes what a running request computes with.

Only the store changes this table (on the engine thread); the retirement rule is the store's:
versions beyond the limit leave the table once nothing holds them.
"""

from __future__ import annotations

from collections.abc import Iterator

from loraserve.types import AdapterConflictError

SEPARATOR = "@"


def split_model(model: str) -> tuple[str, int | None]:
    """'name@N' -> (name, N); 'name' -> (name, None). Adapter names cannot contain '@'."""
    name, sep, version = model.partition(SEPARATOR)
    if not sep:
        return name, None
    if not version.isdigit() or version.startswith("0"):
        return model, None  # not a version suffix: looked up as a plain (unknown) name
    return name, int(version)


def label(name: str, version: int) -> str:
    return f"{name}{SEPARATOR}{version}"


class VersionTable:
    def __init__(self) -> None:
        self._live: dict[str, dict[int, int]] = {}  # name -> {version: uid}, oldest first
        self._last: dict[str, int] = {}  # name -> the last version number handed out

    def next_version(self, name: str, wanted: int | None = None) -> int:
        """The number the next load of `name` gets: one more than the last, or `wanted` (a
        deployment that numbers versions itself) if that is higher than any so far."""
        last = self._last.get(name, 0)
        if wanted is not None and wanted <= last:
            raise AdapterConflictError(f"version {wanted} of {name!r} is not newer than its "
                                       f"version {last}")
        return last + 1 if wanted is None else wanted

    def add(self, name: str, version: int, uid: int) -> None:
        self._live.setdefault(name, {})[version] = uid
        self._last[name] = max(version, self._last.get(name, 0))

    def remove(self, name: str, version: int) -> int:
        versions = self._live[name]
        uid = versions.pop(version)
        if not versions:
            del self._live[name]
        return uid

    def resolve(self, model: str) -> int | None:
        """The uid `name` (newest) or `name@N` means now, or None."""
        name, version = split_model(model)
        versions = self._live.get(name)
        if not versions:
            return None
        if version is None:
            return versions[max(versions)]
        return versions.get(version)

    def newest(self, name: str) -> tuple[int, int] | None:
        """(version, uid) of the newest live version of `name`."""
        versions = self._live.get(name)
        if not versions:
            return None
        v = max(versions)
        return v, versions[v]

    def live(self, name: str) -> dict[int, int]:
        """version -> uid of every live version of `name`, oldest first."""
        return dict(sorted(self._live.get(name, {}).items()))

    def last_version(self, name: str) -> int:
        return self._last.get(name, 0)

    def names(self) -> Iterator[str]:
        return iter(self._live)

    def __contains__(self, name: str) -> bool:
        return name in self._live
