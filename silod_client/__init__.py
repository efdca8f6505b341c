"""Python client of the silod REST API (`Client`) and the training-loop reporter (`reporter`).

`silod_client.reporter` is standard-library only, so a training image needs nothing more to
report its step times; `Client` needs httpx and pydantic.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ApiError", "Client", "TransportError", "WaitTimeout", "SilodError", "models"]


def __getattr__(name: str) -> Any:
    # Lazy: importing silod_client.reporter must not import httpx or pydantic.
    if name == "Client":
        return importlib.import_module("silod_client.client").Client
    if name in ("ApiError", "TransportError", "WaitTimeout", "SilodError"):
        return getattr(importlib.import_module("silod_client.errors"), name)
    if name == "models":
        return importlib.import_module("silod_client.models")
    raise AttributeError(name)
