"""o3edge.settings: load order, environment and command-line overrides, rejection, reload diff."""

import dataclasses
from pathlib import Path

import pytest

from o3edge import settings as settings_module
from o3edge.config import O3Config
from o3edge.errors import ConfigError
from o3edge.policy import ClassLimits
from o3edge.settings import Settings, is_reloadable, load_settings

EXAMPLE = Path(__file__).resolve().parents[1] / "systemd" / "o3edge.toml"


@pytest.fixture(autouse=True)
def no_system_config(tmp_path, monkeypatch):
    # Whatever /etc/o3edge holds on this machine must not leak into the tests.
    monkeypatch.setattr(settings_module, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "o3edge.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_file():
    s = load_settings(None, {}, {})
    assert s == Settings()
    assert s.engine == O3Config()
    assert s.server.endpoint == "ipc:///run/o3edge/o3edge.sock" and s.server.socket_mode == 0o660
    assert s.server.max_message_bytes == 1 << 20 and s.server.queue_max_prompt_tokens == 262144
    assert s.power.meter == "auto" and s.power.energy_log == "" and s.metrics.http_port == 0
    assert s.scheduler.critical == ClassLimits(50, 8, 3)
    assert s.scheduler.high == ClassLimits(200, 16, 5)
    assert s.scheduler.normal == ClassLimits(1000, 32, 10)
    assert s.scheduler.low == ClassLimits(5000, 32, 20)


def test_default_file_is_read_when_present(tmp_path, monkeypatch):
    monkeypatch.setattr(settings_module, "DEFAULT_CONFIG_PATH", write(tmp_path, "[log]\nlevel = 'debug'\n"))
    assert load_settings(None, {}, {}).log.level == "debug"


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(str(tmp_path / "nope.toml"), {}, {})


def test_file_then_env_then_overrides(tmp_path):
    path = write(tmp_path, """
        [engine]
        device = "cuda"
        max_num_seqs = 16
        [server]
        drain_timeout_s = 10
        """.replace("        ", ""))
    env = {"O3EDGE_ENGINE_DEVICE": "cpu", "O3EDGE_ENGINE_INT4_FFN": "yes",
           "O3EDGE_SERVER_ENDPOINT": "ipc:///tmp/o3.sock"}
    s = load_settings(path, env, {"engine.device": "cuda:1", "server": {"queue_max_requests": 4}})
    assert s.engine.device == "cuda:1"          # override beats env beats file
    assert s.engine.max_num_seqs == 16          # file only
    assert s.engine.int4_ffn is True            # env only, parsed
    assert s.server.endpoint == "ipc:///tmp/o3.sock"
    assert s.server.drain_timeout_s == 10.0 and isinstance(s.server.drain_timeout_s, float)
    assert s.server.queue_max_requests == 4


def test_env_values_are_parsed_by_type():
    s = load_settings(None, {
        "O3EDGE_SERVER_SOCKET_MODE": "0640",
        "O3EDGE_ENGINE_NUM_KV_BLOCKS": "512",
        "O3EDGE_ENGINE_MODEL_PATH": "",                 # empty: unset
        "O3EDGE_POWER_PREFILL_WEIGHT": "0.25",
        "O3EDGE_SCHEDULER_NORMAL_MAX_WAIT_MS": "500",
        "O3EDGE_LOG_LEVEL": "WARNING",
        "O3EDGE_SOMETHING_ELSE": "not a setting",        # not a section: left alone
    }, {})
    assert s.server.socket_mode == 0o640 and s.engine.num_kv_blocks == 512
    assert s.engine.model_path is None and s.power.prefill_weight == 0.25
    assert s.scheduler.normal == ClassLimits(500, 32, 10)  # the rest of the class keeps defaults
    assert s.log.level == "warning"


def test_overrides_skip_none_and_parse_strings():
    s = load_settings(None, {}, {"engine.device": None, "engine.max_num_seqs": "4", "metrics.http_port": 9100})
    assert s.engine.device == "auto" and s.engine.max_num_seqs == 4 and s.metrics.http_port == 9100


@pytest.mark.parametrize("text, culprit", [
    ("[engine]\ndevcie = 'cpu'\n", "engine.devcie"),
    ("[servr]\nendpoint = 'ipc:///x'\n", "servr"),
    ("[scheduler.normal]\nmax_wait = 5\n", "scheduler.normal.max_wait"),
    ("[scheduler.urgent]\nmax_wait_ms = 5\n", "scheduler.urgent"),
    ("[power]\nmeter = 'auto'\ncolour = 1\n", "power.colour"),
])
def test_unknown_keys_in_file_are_rejected_by_name(tmp_path, text, culprit):
    with pytest.raises(ConfigError, match=culprit):
        load_settings(write(tmp_path, text), {}, {})


def test_unknown_env_and_override_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="O3EDGE_ENGINE_DEVCE"):
        load_settings(None, {"O3EDGE_ENGINE_DEVCE": "cpu"}, {})
    with pytest.raises(ConfigError, match="engine.devce"):
        load_settings(None, {}, {"engine.devce": "cpu"})


@pytest.mark.parametrize("text, message", [
    ("[engine]\nmax_num_seqs = '8'\n", "engine.max_num_seqs must be int"),
    ("[engine]\ncuda_graphs = 1\n", "engine.cuda_graphs must be bool"),
    ("[engine]\ndevice = 1\n", "engine.device must be str"),
    ("[engine]\ndevice = 'tpu'\n", "device must be"),
    ("[server]\ntcp_endpoint = 'tcp://0.0.0.0:7860'\n", "loopback"),
    ("[server]\ntcp_endpoint = 'tcp://192.168.1.5:7860'\n", "loopback"),
    ("[server]\ntcp_endpoint = 'tcp://eth0:7860'\n", "loopback"),
    ("[server]\ntcp_endpoint = 'tcp://127.0.0.1'\n", "port"),
    ("[server]\nendpoint = 'ipc://@o3edge'\n", "server.endpoint"),
    ("[server]\nendpoint = 'tcp://127.0.0.1:5555'\n", "server.endpoint"),
    ("[server]\nsocket_mode = 660\n", "socket_mode"),
    ("[power]\nmeter = 'watts'\n", "power.meter"),
    ("[power]\nenergy_log = 'energy.jsonl'\n", "absolute"),
    ("[log]\nlevel = 'loud'\n", "log.level"),
    ("[scheduler.high]\nmax_concurrent = 0\n", "scheduler.high.max_concurrent"),
    ("[kv]\nrouter_select = 'heads'\n", "router_select"),
    ("[engine\n", "invalid TOML"),
    ("engine = 3\n", "must be a table"),
])
def test_bad_values_are_rejected_when_built(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(write(tmp_path, text), {}, {})


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:7860", "tcp://[::1]:7860", "tcp://localhost:7860",
                                      "tcp://127.0.0.2:1"])
def test_loopback_tcp_endpoints_are_accepted(endpoint):
    assert load_settings(None, {"O3EDGE_SERVER_TCP_ENDPOINT": endpoint}, {}).server.tcp_endpoint == endpoint


def test_settings_are_frozen():
    s = load_settings(None, {}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.server.endpoint = "ipc:///elsewhere"  # type: ignore[misc]


def test_example_config_loads_and_lists_every_setting():
    s = load_settings(str(EXAMPLE), {}, {})
    assert s == Settings()  # the example documents the defaults
    text = EXAMPLE.read_text()
    for section, values in Settings().as_dict().items():
        if section == "scheduler":
            for cls, limits in values.items():
                block = text.split(f"[scheduler.{cls}]")[1].split("[")[0]
                assert all(f"\n{key} = " in block for key in limits), cls
        else:
            block = text.split(f"[{section}]")[1].split("\n[")[0]
            missing = [key for key in values if f"\n{key} = " not in block]
            assert not missing, f"[{section}] lacks {missing}"


def test_reload_diff_splits_applied_from_restart(tmp_path):
    old = load_settings(None, {}, {})
    new = load_settings(None, {}, {
        "log.level": "debug", "power.energy_log": "/var/log/o3edge/energy.jsonl",
        "scheduler.low.max_wait_ms": 9000, "server.queue_max_requests": 16,
        "server.queue_max_prompt_tokens": 1000,
        "engine.device": "cpu", "server.endpoint": "ipc:///run/o3edge/other.sock",
        "power.meter": "rapl", "metrics.http_port": 9100,
    })
    applied, needs_restart = old.reloadable_diff(new)
    assert applied == ["log.level", "power.energy_log", "scheduler.low.max_wait_ms",
                       "server.queue_max_prompt_tokens", "server.queue_max_requests"]
    assert needs_restart == ["engine.device", "metrics.http_port", "power.meter", "server.endpoint"]
    assert old.reloadable_diff(old) == ([], [])


def test_reloaded_takes_only_what_a_sighup_applies():
    old = load_settings(None, {}, {})
    new = load_settings(None, {}, {"log.level": "error", "engine.device": "cpu",
                                   "scheduler.critical.max_concurrent": 2})
    running = old.reloaded(new)
    assert running.log.level == "error" and running.scheduler.critical.max_concurrent == 2
    assert running.engine.policy.classes.critical.max_concurrent == 2  # the engine serves by the new classes
    assert running.engine == dataclasses.replace(old.engine, policy=running.engine.policy)  # and nothing else
    applied, needs_restart = running.reloadable_diff(new)
    assert applied == [] and needs_restart == ["engine.device"]


def test_reloadable_names():
    assert is_reloadable("scheduler.high.max_wait_ms") and is_reloadable("log.level")
    assert not is_reloadable("server.endpoint") and not is_reloadable("engine.kv_block_size")
    assert not is_reloadable("scheduler")  # only names inside it


def test_kv_section_sets_the_engines_cold_tier_and_only_there(tmp_path):
    s = load_settings(None, {"O3EDGE_KV_COLD_TIER_MB": "512"}, {"kv.cold_tier_dir": "/run/o3edge-shm"})
    assert (s.kv.cold_tier_mb, s.engine.cold_tier_mb, s.engine.cold_tier_dir) == (512, 512, "/run/o3edge-shm")
    assert "cold_tier_mb" not in s.as_dict()["engine"]
    assert s.reloadable_diff(load_settings(None, {}, {}))[1] == ["kv.cold_tier_dir", "kv.cold_tier_mb"]
    with pytest.raises(ConfigError, match=r"engine\.cold_tier_mb.*\[kv\]"):
        load_settings(None, {}, {"engine.cold_tier_mb": 64})
    with pytest.raises(ConfigError, match="kv.cold_tier_mb"):
        load_settings(None, {"O3EDGE_KV_COLD_TIER_MB": "-1"}, {})


def test_kv_section_sets_the_routers_settings_in_the_engine(tmp_path):
    s = load_settings(write(tmp_path, '[kv]\nrouter = "int4"\nrouter_select = "blocks"\nrouter_refresh_steps = 16\n'),
                      {"O3EDGE_KV_ROUTER_THRESHOLD": "0.6"}, {})
    e = s.engine
    assert (e.kv_router, e.router_select, e.router_refresh_steps, e.router_threshold) == ("int4", "blocks", 16, 0.6)
