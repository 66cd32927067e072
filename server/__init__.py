"""Rollout Recorder server: sessions, episode splitting, the trajectory store, the gRPC service.

``start_server`` and its types load on first use, so that the core (sessions, episodes,
ingest, store, durability) imports without gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["RunningServer", "ServerOptions", "start_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .app import RunningServer, ServerOptions, start_server
