"""The daemon's one frozen settings object: a TOML file, then O3EDGE_* variables, then the command line.

`load_settings` builds it once and checks it; anything unknown is rejected by name with a
ConfigError. Sections: [engine] (o3edge.config.O3Config), [kv] (the KV cache's cold tier, passed
to the engine config), [server], [power], [metrics], [log], [scheduler] (one table per priority
class), [http] and [upstream] (o3edge.http.config). The example /etc/o3edge/o3edge.toml lists every key. This module is the loader of the
engine's O3Config: [scheduler] and server.queue_max_* become its policy (o3edge.policy), [kv] its
cold-tier fields; the policy is defined there once.

Environment: O3EDGE_<SECTION>_<KEY>, e.g. O3EDGE_ENGINE_DEVICE=cpu,
O3EDGE_SCHEDULER_NORMAL_MAX_WAIT_MS=500. A variable naming a known section must name a known key;
other O3EDGE_* variables are not settings and are left alone. Text values are parsed by the
setting's type; an empty value means "unset" for optional settings.

Reload (SIGHUP): the daemon builds a new Settings and calls `old.reloadable_diff(new)`. These apply
at once: log.level, power.energy_log, scheduler.* (class limits), server.queue_max_requests and
server.queue_max_prompt_tokens. Everything else (engine.*, kv.*, the server endpoints and socket
options, the power meter, metrics) needs a restart: `old.reloaded(new)` keeps the old values there.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (Jetson's Ubuntu 22.04): the same parser, from PyPI
    import tomli as tomllib

from o3edge.config import O3Config
from o3edge.errors import ConfigError
from o3edge.http.config import HttpSettings, UpstreamPolicy, UpstreamSettings
from o3edge.ipc.protocol import DEFAULT_ENDPOINT
from o3edge.policy import Policy, SchedulerPolicy
from o3edge.power.meter import METER_CHOICES as METERS

DEFAULT_CONFIG_PATH = "/etc/o3edge/o3edge.toml"
ENV_PREFIX = "O3EDGE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
RELOADABLE = ("log.level", "power.energy_log", "scheduler.*",
              "server.queue_max_requests", "server.queue_max_prompt_tokens")
KV_IN_ENGINE = ("cold_tier_mb", "cold_tier_dir", "kv_router", "router_threshold", "sink_tokens", "recent_tokens",
                "router_refresh_steps", "router_select")  # [kv] settings the engine config carries
LOADED_INTO_ENGINE = (*KV_IN_ENGINE, "policy")  # engine fields other sections fill, not [engine]
_OCTAL = {"octal": True}  # field metadata: text values are octal (a file mode)


@dataclass(frozen=True)
class ServerSettings:
    """The IPC server: where it listens and how much one client may ask of it."""

    endpoint: str = DEFAULT_ENDPOINT
    tcp_endpoint: str | None = None  # loopback only, e.g. tcp://127.0.0.1:7860
    socket_mode: int = field(default=0o660, metadata=_OCTAL)
    max_inflight_per_client: int = 8
    max_message_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0  # keep below the unit's TimeoutStopSec (45 s)
    queue_max_requests: int = Policy.queue_max_requests  # the engine's policy: o3edge.policy.Policy
    queue_max_prompt_tokens: int = Policy.queue_max_prompt_tokens
    # Who may connect, beyond the socket file's mode: uids or user names, gids or group names,
    # comma-separated; both empty = anyone who can open the socket. The daemon's own uid always may.
    allowed_uids: str = ""
    allowed_groups: str = ""
    max_connections_per_uid: int = 256

    def __post_init__(self):
        path = self.endpoint.removeprefix("ipc://")
        if path == self.endpoint or not path.startswith("/"):
            raise ConfigError(f"server.endpoint must be ipc:///absolute/path (TCP goes in "
                              f"server.tcp_endpoint), got {self.endpoint!r}")
        if self.tcp_endpoint is not None:
            _check_loopback(self.tcp_endpoint)
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"server.socket_mode must be a file mode 0o000-0o777, got {self.socket_mode:#o}")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"server.max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ConfigError(f"server.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _check_positive(self, "server", ("max_inflight_per_client", "queue_max_requests",
                                         "queue_max_prompt_tokens", "max_connections_per_uid"))
        from o3edge.ipc.access import parse_gids, parse_uids  # names must exist now, not at first connect
        try:
            parse_uids(self.allowed_uids), parse_gids(self.allowed_groups)
        except ConfigError as e:
            raise ConfigError(f"server.allowed_uids/allowed_groups: {e}") from None


@dataclass(frozen=True)
class PowerSettings:
    """Energy metering: which meter, how often, where the JSON-lines log goes.

    energy_log '' means energy.jsonl in the service's state directory ($STATE_DIRECTORY, set by the
    systemd unit), and no log when there is none.
    """

    meter: str = "auto"
    sample_interval_ms: int = 100
    energy_log: str = ""
    prefill_weight: float = 0.1  # energy of a prefill token relative to a decode token

    def __post_init__(self):
        if self.meter not in METERS:
            raise ConfigError(f"power.meter must be one of {METERS}, got {self.meter!r}")
        _check_positive(self, "power", ("sample_interval_ms",))
        _check_path(self.energy_log, "power.energy_log")
        if not (math.isfinite(self.prefill_weight) and self.prefill_weight >= 0):
            raise ConfigError(f"power.prefill_weight must be >= 0, got {self.prefill_weight}")


@dataclass(frozen=True)
class MetricsSettings:
    """Prometheus output: a textfile ('' = none) and/or an HTTP port on 127.0.0.1 (0 = off)."""

    textfile: str = ""
    http_port: int = 0

    def __post_init__(self):
        _check_path(self.textfile, "metrics.textfile")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"metrics.http_port must be 0-65535, got {self.http_port}")


@dataclass(frozen=True)
class LogSettings:
    level: str = "info"

    def __post_init__(self):
        object.__setattr__(self, "level", self.level.lower())  # accept INFO as well as info
        if self.level not in LOG_LEVELS:
            raise ConfigError(f"log.level must be one of {LOG_LEVELS}, got {self.level!r}")


@dataclass(frozen=True)
class KVSettings:
    """The KV cache's shared-memory cold tier and token router (docs/kv-cache.md); the engine config gets
    these values."""

    cold_tier_mb: int = 0  # 0: off
    cold_tier_dir: str = "/dev/shm"
    router: str = "off"  # off | int8 | int4
    router_threshold: float = 0.85
    sink_tokens: int = 4
    recent_tokens: int = 128
    router_refresh_steps: int = 32
    router_select: str = "tokens"  # tokens | blocks

    def __post_init__(self):
        if self.cold_tier_mb < 0:
            raise ConfigError(f"kv.cold_tier_mb must be >= 0, got {self.cold_tier_mb}")
        if not os.path.isabs(self.cold_tier_dir):
            raise ConfigError(f"kv.cold_tier_dir must be an absolute path, got {self.cold_tier_dir!r}")


@dataclass(frozen=True)
class Settings:
    """Everything o3edged is configured with; built once by `load_settings`, never mutated."""

    engine: O3Config = field(default_factory=O3Config)
    kv: KVSettings = field(default_factory=KVSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    power: PowerSettings = field(default_factory=PowerSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    log: LogSettings = field(default_factory=LogSettings)
    scheduler: SchedulerPolicy = field(default_factory=SchedulerPolicy)  # the classes of engine.policy
    http: HttpSettings = field(default_factory=HttpSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)

    def as_dict(self) -> dict:
        """Nested plain dict, one table per section ([kv], [scheduler] and the queue bounds appear
        there only, not under engine)."""
        table = dataclasses.asdict(self)
        for key in LOADED_INTO_ENGINE:
            del table["engine"][key]
        return table

    def reloadable_diff(self, new: "Settings") -> tuple[list[str], list[str]]:
        """Changed settings as dotted names: (those a SIGHUP applies, those that need a restart)."""
        old_values, new_values = flatten(self.as_dict()), flatten(new.as_dict())
        changed = sorted(name for name in old_values if old_values[name] != new_values[name])
        applied = [name for name in changed if is_reloadable(name)]
        return applied, [name for name in changed if not is_reloadable(name)]

    def reloaded(self, new: "Settings") -> "Settings":
        """These settings with the reloadable ones taken from `new` (what a SIGHUP runs with)."""
        table = self.as_dict()
        for name in self.reloadable_diff(new)[0]:
            section, *keys = name.split(".")
            target = table[section]
            for key in keys[:-1]:
                target = target[key]
            target[keys[-1]] = _lookup(new, name)
        return _build(table)


def is_reloadable(name: str) -> bool:
    """True when the dotted setting `name` takes effect on SIGHUP without a restart."""
    return any(name == rule or (rule.endswith(".*") and name.startswith(rule[:-1]))
               for rule in RELOADABLE)


def load_settings(path: str | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Defaults < TOML file < environment < overrides; raises ConfigError naming the culprit.

    `path` None reads DEFAULT_CONFIG_PATH if it exists; an explicit path must exist. `env` None
    means os.environ. `overrides` maps "section.key" (or section -> {key: value}) to values;
    strings are parsed like environment values and None values are skipped (flags not given).
    """
    layers = [_read_file(path), _from_env(os.environ if env is None else env),
              _from_overrides(overrides or {})]
    merged: dict = {}
    for layer in layers:
        _merge(merged, layer)
    return _build(merged)


# --- reading the three sources ---------------------------------------------------------------

def _read_file(path: str | None) -> dict:
    explicit = path is not None
    path = path if explicit else DEFAULT_CONFIG_PATH
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file not found: {path}") from None
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return _check_table(Settings, data, "", path, from_text=False)


def _from_env(env: Mapping[str, str]) -> dict:
    sections = {f.name for f in dataclasses.fields(Settings)}
    layer: dict = {}
    for var in sorted(env):
        rest = var[len(ENV_PREFIX):].lower() if var.startswith(ENV_PREFIX) else ""
        if rest.split("_", 1)[0] not in sections:
            continue
        keys = _env_keys(Settings, rest)
        if keys is None:
            section = rest.split("_", 1)[0]
            raise ConfigError(f"{var}: no such setting in [{section}]")
        _merge(layer, _check_table(Settings, _nest(keys, env[var]), "", var, from_text=True))
    return layer


def _from_overrides(overrides: Mapping[str, Any]) -> dict:
    layer: dict = {}
    for key, value in overrides.items():
        nested = _nest(key.split("."), value) if "." in key else {key: value}
        _merge(layer, _check_table(Settings, _drop_none(nested), "", "command line", from_text=True))
    return layer


def _env_keys(cls, rest: str) -> list[str] | None:
    """'scheduler_normal_max_wait_ms' -> ['scheduler', 'normal', 'max_wait_ms'] (None if unknown)."""
    for f, hint in _hints(cls).items():
        if dataclasses.is_dataclass(hint) and rest.startswith(f + "_"):
            keys = _env_keys(hint, rest[len(f) + 1:])
            if keys is not None:
                return [f, *keys]
        elif rest == f:
            return [f]
    return None


# --- checking and building --------------------------------------------------------------------

def _check_table(cls, table: Any, prefix: str, source: str, from_text: bool) -> dict:
    """Type-check one table against the dataclass `cls`, recursing into nested sections."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {where} must be a table, got {table!r}")
    hints = _hints(cls)
    unknown = sorted(set(table) - set(hints))
    if unknown:
        names = ", ".join(prefix + k for k in unknown)
        raise ConfigError(f"{source}: unknown setting(s): {names}")
    out = {}
    for key, value in table.items():
        hint, name = hints[key], prefix + key
        if dataclasses.is_dataclass(hint):
            out[key] = _check_table(hint, value, name + ".", source, from_text)
        else:
            octal = _field(cls, key).metadata.get("octal", False)
            out[key] = _coerce(value, hint, name, source, from_text, octal)
    return out


def _coerce(value: Any, hint: Any, name: str, source: str, from_text: bool, octal: bool) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # X | None: '' or None means unset
        if value is None or value == "":
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if octal and isinstance(value, str):
            return int(value.removeprefix("0o"), 8)
        if from_text and isinstance(value, str) and hint is not str:
            return _parse_text(value, hint)
    except ValueError:
        raise ConfigError(f"{source}: {name} must be {hint.__name__}, got {value!r}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {name} must be {hint.__name__}, got {value!r}")
    return value


def _parse_text(text: str, hint: type) -> Any:
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    return hint(int(text, 0) if hint is int else text)


def _build(merged: dict) -> Settings:
    engine, kv = dict(merged.get("engine", {})), KVSettings(**merged.get("kv", {}))
    misplaced = sorted(k for k in engine if k in LOADED_INTO_ENGINE)
    if misplaced:
        raise ConfigError(f"{', '.join('engine.' + k for k in misplaced)}: set these in [kv], [scheduler] "
                          "and server.queue_max_*")
    server = ServerSettings(**merged.get("server", {}))
    scheduler = SchedulerPolicy.from_dict(merged.get("scheduler", {}))
    policy = Policy(scheduler, server.queue_max_requests, server.queue_max_prompt_tokens)
    engine.update(cold_tier_mb=kv.cold_tier_mb, cold_tier_dir=kv.cold_tier_dir, kv_router=kv.router,
                  router_threshold=kv.router_threshold, sink_tokens=kv.sink_tokens, recent_tokens=kv.recent_tokens,
                  router_refresh_steps=kv.router_refresh_steps, router_select=kv.router_select, policy=policy)
    return Settings(
        engine=O3Config.from_dict(engine),
        kv=kv,
        server=server,
        power=PowerSettings(**merged.get("power", {})),
        metrics=MetricsSettings(**merged.get("metrics", {})),
        log=LogSettings(**merged.get("log", {})),
        scheduler=scheduler,
        http=HttpSettings(**merged.get("http", {})),
        upstream=_upstream(merged.get("upstream", {})),
    )


def _upstream(table: dict) -> UpstreamSettings:
    policy = UpstreamPolicy(**table.get("policy", {}))
    return UpstreamSettings(**{**table, "policy": policy})


def _check_loopback(endpoint: str) -> None:
    hostport = endpoint.removeprefix("tcp://")
    host, _, port = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if hostport == endpoint or not is_loopback:
        raise ConfigError(f"server.tcp_endpoint must be tcp://<loopback address>:<port> (anything "
                          f"else would need CURVE keys), got {endpoint!r}")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"server.tcp_endpoint needs a port 1-65535, got {endpoint!r}")


def _check_path(path: str, name: str) -> None:
    if path and not os.path.isabs(path):
        raise ConfigError(f"{name} must be an absolute path or empty, got {path!r}")


def _check_positive(obj, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            dotted = f"{section}.{name}" if section else name
            raise ConfigError(f"{dotted} must be positive, got {getattr(obj, name)}")


# --- small helpers ----------------------------------------------------------------------------

def _hints(cls) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _field(cls, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _nest(keys: list[str], value: Any) -> dict:
    for key in reversed(keys):
        value = {key: value}
    return value


def _merge(into: dict, layer: dict) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _drop_none(table: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """{"classes": {"low": {"running": 0}}} -> {"classes.low.running": 0} (an empty table stays a value)."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _lookup(settings: Settings, name: str) -> Any:
    value: Any = settings
    for key in name.split("."):
        value = getattr(value, key)
    return value
