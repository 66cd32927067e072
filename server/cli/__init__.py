"""The `rollout-recorder` command line (`main`)."""

from .main import main

__all__ = ["main"]
