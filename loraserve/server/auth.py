"""API keys, checked before a request body is read.

- `--api-key`: every route but /health and the dashboard's static files needs
  `Authorization: Bearer KEY` (the admin key works too). Keys are compared with
  `hmac.compare_digest` (constant time, CVE-2025-59425).
- Adapter load/unload routes are off (403) unless `--admin-api-key` (then they need THAT key)
  or `--allow-runtime-lora-updates` (loopback hosts only; checked in ServerSettings).
- What is the operator's (/debug/state, /debug/invariants, /v1/reload_api_keys, the server's
  file paths in /v1/models; with tenant keys also /metrics, which names every tenant and
  adapter) is shown to the operator only: a request bearing the admin key, or, with no admin
  key set, any request to a server bound to a loopback host (its clients are on the
  operator's machine).
- `--api-keys-file`: tenant keys (api_keys.py). A tenant key passes wherever `--api-key` does;
  the request then carries its Tenant (scope["state"]["tenant"]) for the adapter scope and
  the limits. The admin key and `--api-key` carry none: they are not limited.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from loraserve.server import dashboard
from loraserve.server.api_keys import KeyRing, Tenant
from loraserve.server.errors import error_bytes
from loraserve.server.settings import ServerSettings, is_loopback

# the dashboard's static files hold no data; the page sends the key with what it fetches
OPEN_PATHS = frozenset({"/health", *dashboard.PATHS})
OPERATOR_PATHS = frozenset({"/debug/state", "/debug/invariants", "/v1/reload_api_keys"})
TENANT_OPERATOR_PATHS = frozenset({"/metrics"})  # operator-only once tenants exist
ADMIN_PATHS = frozenset({f"{prefix}/{verb}_lora_adapter" for prefix in ("/v1", "")
                         for verb in ("load", "unload", "upload")})


def bearer_token(scope: Scope) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def key_matches(token: str | None, key: str | None) -> bool:
    if not key or token is None:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


def is_operator(token: str | None, s: ServerSettings) -> bool:
    if s.admin_api_key:
        return key_matches(token, s.admin_api_key)
    return is_loopback(s.host)


def check_access(path: str, token: str | None, s: ServerSettings,
                 tenant: Tenant | None = None, tenants: bool = False) -> tuple[int, str] | None:
    """None if allowed, else (status, message). `tenant`: the tenant the token is a key of;
    `tenants`: whether a keys file is in force."""
    if path in OPEN_PATHS:
        return None
    if path in ADMIN_PATHS:
        if not s.runtime_lora_updates:
            return 403, ("runtime LoRA adapter loading is disabled: start the server with "
                         "--admin-api-key KEY (then send that key) or, on a loopback host, "
                         "--allow-runtime-lora-updates")
        if s.admin_api_key:
            if key_matches(token, s.admin_api_key):
                return None
            return 401, "this route needs the admin API key (Authorization: Bearer ADMIN_KEY)"
        if tenant is not None:
            return 403, "loading and unloading adapters is the operator's, not a tenant's"
    if (s.api_key or tenants) and tenant is None and not (
            key_matches(token, s.api_key) or key_matches(token, s.admin_api_key)):
        return 401, "invalid or missing API key (send Authorization: Bearer KEY)"
    operator_only = path in OPERATOR_PATHS or (tenants and path in TENANT_OPERATOR_PATHS)
    if operator_only and (tenant is not None or not is_operator(token, s)):
        return 403, "this route is for the server's operator (send the admin API key)"
    return None


class AuthMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings, keys: KeyRing | None = None):
        self.app = app
        self.settings = settings
        self.keys = keys or KeyRing(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = bearer_token(scope)
        admin = key_matches(token, self.settings.admin_api_key)
        tenant = None if admin else self.keys.table.lookup(token)
        operator = tenant is None and is_operator(token, self.settings)  # a tenant never is
        denied = check_access(scope["path"].rstrip("/") or "/", token, self.settings, tenant,
                              self.keys.active)
        if denied is None:
            state = scope.setdefault("state", {})
            state["operator"], state["tenant"] = operator, tenant
            return await self.app(scope, receive, send)
        status, message = denied
        code = "invalid_api_key" if status == 401 else "forbidden"
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": error_bytes(status, message, code)})
