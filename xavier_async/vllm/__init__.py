"""xavier_async inside vLLM: :class:`XavierConnector`, a KV connector that shares prefix
blocks between vLLM replicas (``kv_connector_module_path="xavier_async.vllm"``).

``XavierConnector`` is imported on first use, so the pure parts (the directory, the
scheduler's planning, the settings) import without vLLM."""

from typing import TYPE_CHECKING, Any

from .directory import Directory, Hit
from .metadata import LoadSpec, StepPlan
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from .connector import XavierConnector, XavierConnectorMetadata

__all__ = ["XavierConnector", "XavierConnectorMetadata", "ConnectorSettings", "Directory", "Hit",
           "LoadSpec", "StepPlan"]


def __getattr__(name: str) -> Any:
    if name in ("XavierConnector", "XavierConnectorMetadata"):
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
