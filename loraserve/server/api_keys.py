"""Tenant keys (`--api-keys-file`): who a bearer key is, what it may use, and its limits.

The file is JSON:

    {"keys": {"<key>": {"name": "tenant-a", "adapters": ["a0", "a1"] | "*", "base": true,
                        "max_concurrent": 8, "requests_per_minute": 60,
                        "tokens_per_minute": 20000}}}

`name` is the tenant (several keys may share one tenant, with the same settings: rotation);
`adapters` are the adapter names the key may see and use ("*": every one; default none);
`base` whether it may use the base model (default true); every limit is optional (absent or
null: none). Anything else in the file is refused, naming it. The table is swapped as a whole
on reload (`KeyRing.reload`): a file that does not parse or validate changes nothing.

Keys are looked up in constant time: the caller's key is compared (hmac.compare_digest, on
SHA-256 digests, so lengths leak nothing either) against every key, always all of them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from dataclasses import dataclass

from loraserve.types import is_valid_adapter_name

MAX_FILE_BYTES = 4 << 20
LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")
_FIELDS = {"name", "adapters", "base", *LIMITS}


@dataclass(frozen=True)
class Tenant:
    name: str
    adapters: frozenset[str] | None = frozenset()  # None: every adapter ("*")
    base: bool = True
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def may_use(self, adapter: str | None) -> bool:
        """Whether this tenant may see and use `adapter` (None: the base model)."""
        if adapter is None:
            return self.base
        return self.adapters is None or adapter in self.adapters

    def limit(self, which: str) -> int | None:
        return getattr(self, which)


class KeyFileError(ValueError):
    """The keys file cannot be used; the message names the file and what is wrong."""


class KeyTable:
    def __init__(self, tenants_by_key: dict[str, Tenant]):
        self._entries = [(hashlib.sha256(k.encode()).digest(), t)
                         for k, t in tenants_by_key.items()]
        self.tenants: dict[str, Tenant] = {t.name: t for t in tenants_by_key.values()}

    def lookup(self, token: str | None) -> Tenant | None:
        if token is None:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for key_digest, tenant in self._entries:  # no early exit: constant time
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found

    @property
    def empty(self) -> bool:
        return not self._entries


def parse_keys(text: bytes, where: str, reserved: tuple[str | None, ...] = ()) -> KeyTable:
    """The validated table in `text`; `reserved`: keys that already have another role."""
    def fail(problem: str) -> KeyFileError:
        return KeyFileError(f"api keys file {where}: {problem}")

    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise fail(f"not valid JSON ({e})") from None
    if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], dict):
        raise fail('it must be an object with one field, "keys", an object of key -> tenant')
    tenants: dict[str, Tenant] = {}
    for key, spec in data["keys"].items():
        label = f"key #{len(tenants) + 1}"  # never the key itself: files get pasted in logs
        if not key or not key.isprintable() or any(c.isspace() for c in key):
            raise fail(f"{label} is empty or has spaces or control characters")
        if key in reserved:
            raise fail(f"{label} is also --api-key or --admin-api-key")
        tenants[key] = _tenant(spec, lambda p, label=label: fail(f"{label}: {p}"))
    by_name: dict[str, Tenant] = {}
    for t in tenants.values():
        if by_name.setdefault(t.name, t) != t:
            raise fail(f"keys of tenant {t.name!r} disagree on its settings")
    return KeyTable(tenants)


def _tenant(spec: object, fail) -> Tenant:
    if not isinstance(spec, dict):
        raise fail("its tenant must be an object")
    if extra := set(spec) - _FIELDS:
        raise fail(f"unknown fields {sorted(extra)} (known: {sorted(_FIELDS)})")
    name = spec.get("name")
    if not is_valid_adapter_name(name):
        raise fail(f"name must be 1-64 of [A-Za-z0-9._-], got {name!r}")
    adapters = spec.get("adapters", [])
    if adapters == "*":
        adapters = None
    elif isinstance(adapters, list) and all(map(is_valid_adapter_name, adapters)):
        adapters = frozenset(adapters)
    else:
        raise fail(f'adapters must be "*" or a list of adapter names, got {adapters!r}')
    base = spec.get("base", True)
    if not isinstance(base, bool):
        raise fail(f"base must be true or false, got {base!r}")
    limits = {}
    for which in LIMITS:
        v = spec.get(which)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise fail(f"{which} must be a positive integer or null, got {v!r}")
        limits[which] = v
    return Tenant(name, adapters, base, **limits)


class KeyRing:
    """The table in force; `reload` swaps it whole, or leaves it as it was."""

    def __init__(self, path: str | None, reserved: tuple[str | None, ...] = ()):
        self.path = path
        self._reserved = tuple(k for k in reserved if k)
        self._lock = threading.Lock()
        self.table = self._read() if path else KeyTable({})

    @property
    def active(self) -> bool:
        return self.path is not None

    def _read(self) -> KeyTable:
        try:
            with open(self.path, "rb") as f:
                text = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise KeyFileError(f"api keys file {self.path}: {e.strerror or e}") from None
        if len(text) > MAX_FILE_BYTES:
            raise KeyFileError(f"api keys file {self.path}: larger than {MAX_FILE_BYTES} bytes")
        return parse_keys(text, self.path, self._reserved)

    def reload(self) -> KeyTable:
        """Read the file again; raises KeyFileError (the old table stays) if it is bad."""
        if not self.path:
            raise KeyFileError("no --api-keys-file was given: there is nothing to reload")
        with self._lock:
            self.table = self._read()
        return self.table
