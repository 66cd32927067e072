"""The server's optional packages (the ``rollout-recorder[server]`` extra), imported on use.

A plain ``pip install rollout-recorder`` brings the client's packages only, and the server
runs on them as long as nothing below is asked for: the trajectory store (numba), a Prometheus
endpoint (prometheus-client), TensorBoard event files (tensorboardX), gRPC health and
reflection (grpcio-health-checking, grpcio-reflection; without them the server serves and
logs one line). Asking for one that is missing fails at once with `MissingExtraError`,
whose message names the pip line.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install 'rollout-recorder[server]'"

# Import name -> the distribution that provides it.
PACKAGES = {
    "numba": "numba",
    "prometheus_client": "prometheus-client",
    "tensorboardX": "tensorboardX",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
}


class MissingExtraError(ImportError):
    """A feature asked for needs a package of the server extra that is not installed."""


def missing_message(module: str, feature: str) -> str:
    """``"<feature> needs <package>, which is not installed: pip install ..."``."""
    top = module.split(".")[0]
    package = PACKAGES.get(top, top)
    return f"{feature} needs {package}, which is not installed: {INSTALL_HINT}"


def available(module: str) -> bool:
    """Whether `module` can be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, feature: str) -> ModuleType:
    """Import `module` for `feature`; MissingExtraError naming the pip line when absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there; something it imports is not
        raise MissingExtraError(missing_message(module, feature), name=module) from None


__all__ = ["INSTALL_HINT", "MissingExtraError", "available", "missing_message", "require"]
