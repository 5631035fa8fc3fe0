"""The HTTP server's knobs (limits, keys, runtime-adapter policy), separate from the engine's."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    api_key: str | None = None  # guards every route but /health
    admin_api_key: str | None = None  # enables runtime adapter load/unload, with THIS key
    api_keys_file: str | None = None  # tenant keys: scope and limits (server/api_keys.py)
    allow_runtime_lora_updates: bool = False  # enables them without a key (loopback only)
    lora_root: str | None = None  # runtime loads must resolve inside this directory
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the model's context length - 1
    max_tokens_limit: int = 4096
    max_n: int = 16  # most completions one request may ask for (n)
    max_prompts: int = 64  # most prompts in one /v1/completions request
    served_model_names: tuple[str, ...] = ()  # extra names that mean the base model
    disconnect_poll_s: float = 0.1  # how often a non-streaming request checks its client

    def __post_init__(self) -> None:
        if self.allow_runtime_lora_updates and not self.admin_api_key and not is_loopback(
                self.host):
            raise ValueError(
                f"--allow-runtime-lora-updates lets anyone who can reach the server load files "
                f"from its disk; it is only allowed on a loopback --host, not {self.host!r}. "
                "Use --admin-api-key KEY instead.")
        for name, v in (("max_request_bytes", self.max_request_bytes),
                        ("max_tokens_limit", self.max_tokens_limit), ("max_n", self.max_n),
                        ("max_prompts", self.max_prompts)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @property
    def runtime_lora_updates(self) -> bool:
        return bool(self.admin_api_key) or self.allow_runtime_lora_updates


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
