"""The energy service end to end: an IPCServer on a real socket serving the tiny model, with its hooks."""

import json
import socket
import urllib.request

import pytest

from o3edge.energy_service import EnergyService, energy_log_path, state_directory
from o3edge.ipc.client import O3Client
from o3edge.ipc.engine_loop import Hooks
from o3edge.ipc.server import IPCServer
from o3edge.settings import MetricsSettings, PowerSettings, ServerSettings
from tests.helpers import wait_for

PROMPT = "def main():\n    "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_dir):
    """(server, service, state dir): the tiny model behind the service's hooks, as daemon.py wires it."""
    from o3edge.config import O3Config
    from o3edge.engine.engine import LLMEngine

    tmp = tmp_path_factory.mktemp("energy")
    service = EnergyService(PowerSettings(sample_interval_ms=20),
                            MetricsSettings(textfile=str(tmp / "o3edge.prom"), http_port=free_port()),
                            state_dir=str(tmp), textfile_interval_s=0.1)
    load = lambda: LLMEngine(O3Config(model_path=tiny_dir, device="cpu", num_kv_blocks=64), tiny_dir)  # noqa: E731
    server = IPCServer(ServerSettings(endpoint=f"ipc://{tmp}/o3.sock"), load, Hooks(**service.hooks()),
                       idle_wake_s=0.05)
    service.attach(server)
    server.start()
    service.start()
    with O3Client(server.settings.endpoint, timeout=30) as c:
        c.wait_ready(60)
    yield server, service, tmp
    server.close()
    service.close()


@pytest.fixture
def client(served):
    with O3Client(served[0].settings.endpoint, timeout=30) as c:
        yield c


def test_done_reply_carries_energy_with_its_meter_named(served, client):
    service = served[1]
    done = client.generate(PROMPT, max_tokens=16, ignore_eos=True, priority="high")
    e = done.energy
    assert e["meter"] == service.meter.name and e["meter"] in ("estimate", "rapl", "nvml", "nvml+rapl")
    assert e["domains"] == list(service.meter.domains) and e["is_estimate"] == (e["meter"] == "estimate")
    assert e["joules"] >= 0 and isinstance(e["low_confidence"], bool)
    assert 0 < e["tokens"] <= done.completion_tokens and e["prompt_tokens"] >= done.prompt_tokens - 1
    if e["joules"] > 0:
        assert e["tokens_per_joule"] == pytest.approx(e["tokens"] / e["joules"], rel=1e-3)
    assert "request_id" not in e  # the engine's id means nothing to the client


def test_stats_show_tokens_per_joule_active_and_with_idle_over_windows(client):
    client.generate(PROMPT, max_tokens=24, ignore_eos=True)
    energy = wait_for(lambda: (lambda e: e if e["all"]["tokens_per_joule"] else None)(client.stats()["energy"]))
    assert energy, client.stats()["energy"]
    assert energy["meter"] and energy["domains"] and isinstance(energy["is_estimate"], bool)
    for scope in ("all", "last_60s", "last_900s"):
        figures = energy[scope]
        assert figures["tokens"] > 0 and figures["active_joules"] > 0
        assert figures["active_tokens_per_joule"] >= figures["tokens_per_joule"] > 0


def test_energy_log_has_one_line_per_request_with_its_class_and_outcome(served, client):
    log_path = served[2] / "energy.jsonl"
    client.generate(PROMPT, max_tokens=4, ignore_eos=True, priority="low")

    def low_lines():
        if not log_path.exists():
            return []
        return [r for r in map(json.loads, log_path.read_text().splitlines()) if r["priority"] == "low"]

    lines = wait_for(low_lines)
    assert len(lines) == 1
    line = lines[0]
    assert line["finish_reason"] == "length" and line["meter"] == served[1].meter.name
    assert line["domains"] == list(served[1].meter.domains) and line["joules"] >= 0


def test_metrics_textfile_has_energy_request_queue_and_kv_metrics(served, client):
    client.generate(PROMPT, max_tokens=4, ignore_eos=True, priority="critical")
    path = served[2] / "o3edge.prom"
    wanted = 'o3edge_requests_total{finish_reason="length",priority="critical"} 1.0'
    text = wait_for(lambda: path.exists() and wanted in path.read_text() and path.read_text())
    assert text, path.read_text() if path.exists() else "no textfile"
    for name in ("o3edge_energy_joules_total{", "o3edge_tokens_total{kind=\"generated\"}",
                 "o3edge_tokens_per_joule{is_estimate=\"", "scope=\"with_idle\",window=\"60s\"}", "o3edge_energy_meter_info{",
                 "o3edge_queue_depth ", "o3edge_running ", "o3edge_kv_blocks{state=\"used\"}",
                 "o3edge_kv_blocks{state=\"free\"}", "o3edge_prefix_hit_rate ", "o3edge_requests_admitted_total ",
                 "o3edge_class_queue_depth{priority=\"critical\"}", "o3edge_ready 1.0"):
        assert name in text, name
    assert [p.name for p in served[2].iterdir() if p.name.startswith("o3edge.prom")] == ["o3edge.prom"]


def test_http_exporter_answers_on_loopback_only(served):
    host, port = served[1].http_address
    assert host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    assert reply.status == 200 and "o3edge_energy_joules_total" in body and "o3edge_requests_total" in body


def test_a_cancelled_request_is_counted_under_its_outcome_and_class(served, client):
    stream = iter(client.stream(PROMPT, max_tokens=2000, ignore_eos=True, priority="normal"))
    next(stream)
    stream.close()  # cancels it
    wanted = ("cancelled", "normal")
    assert wait_for(lambda: served[1].requests.counts().get(wanted)), served[1].requests.counts()


def test_state_directory_and_log_path_defaults(tmp_path):
    assert state_directory({"STATE_DIRECTORY": "/var/lib/o3edge:/var/lib/other"}) == "/var/lib/o3edge"
    assert state_directory({}) is None
    assert energy_log_path(PowerSettings(), None) is None
    assert str(energy_log_path(PowerSettings(), "/var/lib/o3edge")) == "/var/lib/o3edge/energy.jsonl"
    assert str(energy_log_path(PowerSettings(energy_log="/x/e.jsonl"), "/var/lib/o3edge")) == "/x/e.jsonl"


def test_reload_moves_the_log_and_close_is_idempotent(tmp_path):
    service = EnergyService(PowerSettings(meter="estimate"), MetricsSettings(), state_dir=None)
    assert service.energy_log is None and service.http_address is None
    service.start()
    service.reload(PowerSettings(meter="estimate", energy_log=str(tmp_path / "e.jsonl")))
    service.on_admit("r1", "high")
    energy = service.on_finish("r1", "stop")
    assert energy["meter"] == "estimate" and energy["is_estimate"] is True
    service.close()
    service.close()
    line = json.loads((tmp_path / "e.jsonl").read_text())
    assert line["priority"] == "high" and line["finish_reason"] == "stop"


def test_cli_stats_shows_the_energy_figures(served, client, capsys):
    from o3edge import cli

    client.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert cli.main(["stats", "--endpoint", served[0].settings.endpoint]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "energy.all.tokens_per_joule" in out and "energy.last_60s.active_tokens_per_joule" in out
    last = out.splitlines()[-1]
    assert last.startswith("tokens/J: all time ") and "last 900s" in last and served[1].meter.name in last
