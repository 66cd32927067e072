"""Rollout Recorder server: sessions, episode splitting, and the gRPC service."""

from .app import RunningServer, ServerOptions, start_server

__all__ = ["RunningServer", "ServerOptions", "start_server"]
