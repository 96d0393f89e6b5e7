"""[http] and [upstream] settings: the OpenAI-compatible door's listen address and limits, the upstream engine.

Plain frozen dataclasses checked when built, like every other section of o3edge.settings.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

from o3edge.errors import ConfigError

POLICIES = ("local", "overflow", "prefer-upstream")


@dataclass(frozen=True)
class HttpSettings:
    """The OpenAI-compatible HTTP endpoint: off by default, loopback by default when on."""

    enabled: bool = False
    listen: str = "127.0.0.1:8080"  # host:port; a non-loopback host serves anyone who can reach it
    max_body_bytes: int = 1 << 20  # a larger request body gets 413
    max_header_bytes: int = 8190  # one header line (request line included); larger gets 400/431
    max_headers: int = 64
    max_connections: int = 256  # open connections; one more is answered 503 and closed
    header_timeout_s: float = 15.0  # a connection that has not sent a whole request by then is closed
    body_timeout_s: float = 30.0  # reading one request body
    send_timeout_s: float = 30.0  # a write blocked this long (client not reading, buffers full): request cancelled

    def __post_init__(self):
        split_listen(self.listen)
        for name in ("max_body_bytes", "max_header_bytes", "max_headers", "max_connections"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"http.{name} must be positive, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"http.{name} must be a positive number of seconds, got {value}")

    @property
    def is_loopback(self) -> bool:
        host = split_listen(self.listen)[0]
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class UpstreamPolicy:
    """Per priority class: local (never forward), overflow (forward what would be refused here),
    prefer-upstream (forward first, serve here when the upstream fails)."""

    critical: str = "overflow"
    high: str = "overflow"
    normal: str = "overflow"
    low: str = "overflow"

    def __post_init__(self):
        for name in ("critical", "high", "normal", "low"):
            if getattr(self, name) not in POLICIES:
                raise ConfigError(f"upstream.policy.{name} must be one of {', '.join(POLICIES)}, "
                                  f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class UpstreamSettings:
    """An OpenAI-compatible engine that takes the requests this device cannot ('' url: none)."""

    url: str = ""  # e.g. http://host:8000/v1
    model: str = ""  # the model name the upstream serves
    api_key_file: str = ""  # a file holding the bearer token ('' = no Authorization header)
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 30.0  # longest wait for the upstream's next bytes (first token included)
    max_inflight: int = 64  # requests forwarded at once; past this they are answered here
    breaker_threshold: int = 3  # consecutive upstream failures that open its breaker
    breaker_cooldown_s: float = 10.0  # how long it stays open before one request probes it again
    policy: UpstreamPolicy = field(default_factory=UpstreamPolicy)

    def __post_init__(self):
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"upstream.url must start with http:// or https://, got {self.url!r}")
        if self.url and not self.model:
            raise ConfigError("upstream.model is required with upstream.url (the model the upstream serves)")
        for name in ("connect_timeout_s", "read_timeout_s", "breaker_cooldown_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"upstream.{name} must be >= 0, got {value}")
        for name in ("max_inflight", "breaker_threshold"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"upstream.{name} must be positive, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.url)


def split_listen(listen: str) -> tuple[str, int]:
    """'127.0.0.1:8080' -> ('127.0.0.1', 8080); '[::1]:8080' -> ('::1', 8080); ConfigError otherwise."""
    host, _, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ConfigError(f"http.listen must be host:port (e.g. 127.0.0.1:8080), got {listen!r}")
    return host, int(port)
