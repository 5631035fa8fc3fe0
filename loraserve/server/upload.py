"""POST /v1/upload_lora_adapter: a PEFT adapter sent as a multipart form, for servers that
share no disk with the trainer.

Fields: `lora_name`, optional `replace` and `pinned` ("true"/"false"), and two files:
`config` (adapter_config.json) and `weights` (adapter_model.safetensors). The body is parsed
as it streams in and each file is written straight into a fresh directory of the process's
spill folder (adapters/spill.py), never held whole in memory; each part has a size bound
checked while it streams, so an oversized upload ends early with a 413. The directory is then
loaded like any other adapter path, and the store keeps it as the version's copy on disk.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from fastapi import Request
from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header

from loraserve.adapters.format import CONFIG_FILE, SAFETENSORS_FILE
from loraserve.adapters.spill import spill_dir
from loraserve.server.errors import ApiError

UPLOAD_PATHS = frozenset({"/v1/upload_lora_adapter", "/upload_lora_adapter"})
FILE_PARTS = {"config": CONFIG_FILE, "weights": SAFETENSORS_FILE}
TEXT_PARTS = ("lora_name", "replace", "pinned")
MAX_TEXT_BYTES = 256
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class UploadedAdapter:
    directory: Path
    fields: dict[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        value = self.fields.get(name, "false").strip().lower()
        if value not in ("true", "false", "1", "0"):
            raise ApiError(400, f"{name} must be true or false, got {value[:20]!r}",
                           "invalid_upload", param=name)
        return value in ("true", "1")

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _FormWriter:
    """python-multipart callbacks: text parts into memory, file parts onto disk, bounded."""

    def __init__(self, directory: Path, max_weights_bytes: int):
        self.directory = directory
        self.limits = {"config": MAX_CONFIG_BYTES, "weights": max_weights_bytes}
        self.fields: dict[str, bytearray] = {}
        self.seen: set[str] = set()
        self._header_name = b""
        self._headers: dict[bytes, bytes] = {}
        self._part: str | None = None
        self._size = 0
        self._file: BinaryIO | None = None
        self.error: ApiError | None = None

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_headers_finished": self._open,
                "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._headers, self._header_name, self._size = {}, b"", 0

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        key = self._header_name.lower()
        self._headers[key] = self._headers.get(key, b"") + data[start:end]
        self._header_name = b""

    def _open(self) -> None:
        _, opts = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = opts.get(b"name", b"").decode("utf-8", "replace")
        if name not in FILE_PARTS and name not in TEXT_PARTS:
            raise self._fail(400, f"unknown form field {name[:40]!r} (expected "
                                  f"{', '.join([*TEXT_PARTS, *FILE_PARTS])})")
        if name in self.seen:
            raise self._fail(400, f"form field {name!r} appears twice")
        self.seen.add(name)
        self._part = name
        if name in FILE_PARTS:
            self._file = open(self.directory / FILE_PARTS[name], "wb")  # noqa: SIM115
        else:
            self.fields[name] = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        self._size += end - start
        limit = self.limits.get(self._part, MAX_TEXT_BYTES)
        if self._size > limit:
            raise self._fail(413, f"form field {self._part!r} is over its limit of {limit} "
                                  "bytes")
        if self._file is not None:
            self._file.write(data[start:end])
        else:
            self.fields[self._part] += data[start:end]

    def _end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._part = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _fail(self, status: int, message: str) -> ApiError:
        self.error = ApiError(status, message, "invalid_upload")
        return self.error


async def receive_adapter(request: Request, max_weights_bytes: int) -> UploadedAdapter:
    """Stream the form into a new spill directory. Every failure removes the directory."""
    ctype, opts = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not opts.get(b"boundary"):
        raise ApiError(415, "expected a multipart/form-data body with lora_name, config and "
                            "weights", "invalid_upload")
    directory = spill_dir().new_adapter_dir("upload")
    writer = _FormWriter(directory, max_weights_bytes)
    parser = MultipartParser(opts[b"boundary"], writer.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except (MultipartParseError, ApiError, ValueError) as e:
        writer.close()
        shutil.rmtree(directory, ignore_errors=True)
        if writer.error is not None:
            raise writer.error from None
        raise ApiError(400, f"malformed multipart body: {e}", "invalid_upload") from None
    except BaseException:
        writer.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    upload = UploadedAdapter(directory, {k: v.decode("utf-8", "replace")
                                         for k, v in writer.fields.items()})
    missing = [f for f in ("lora_name", *FILE_PARTS) if f not in writer.seen]
    if missing:
        upload.discard()
        raise ApiError(400, f"missing form field(s): {', '.join(missing)}", "invalid_upload",
                       param=missing[0])
    return upload
