"""The ZeroMQ service: wire protocol, server, and client libraries (blocking and asyncio)."""

from o3edge.ipc.client import Completion, DaemonUnavailable, O3Client, PermissionDenied, RequestError, TokenEvent

__all__ = ["O3Client", "Completion", "TokenEvent", "DaemonUnavailable", "PermissionDenied", "RequestError"]
