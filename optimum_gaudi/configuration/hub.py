"""Fail fast, with a useful message, when something would need the Hugging Face Hub and it is out of reach.

huggingface_hub retries a dead network for ~20 s before giving up with a long traceback; users asking for
a hub model on an offline machine deserve a one-line answer in a few seconds instead.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse

from ..errors import UserError


class HubUnavailableError(UserError, OSError):
    """The Hugging Face Hub was needed but is offline or unreachable."""


def _offline_by_env() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


@lru_cache(maxsize=1)
def _endpoint_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_hub(what: str, hint: str) -> None:
    """Raise HubUnavailableError naming `what` was asked for and `hint` on how to do without the Hub."""
    if _offline_by_env():
        raise HubUnavailableError(f"{what} needs the Hugging Face Hub, but HF_HUB_OFFLINE is set. {hint}")
    if not _endpoint_reachable():
        raise HubUnavailableError(
            f"{what} needs the Hugging Face Hub, which cannot be reached from this machine. {hint}"
        )
