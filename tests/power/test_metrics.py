from o3edge.power.accountant import EnergyAccountant
from o3edge.power.metrics import new_registry, register_energy_metrics, render, write_textfile
from o3edge.power.records import StepTokens
from o3edge.power.sampler import EnergySampler

from .conftest import ScriptedMeter, constant_power

S = 1_000_000_000


def _registry():
    sampler = EnergySampler(ScriptedMeter(("gpu0",)), period_s=0.01)
    sampler.record(constant_power(("gpu0",), 50.0, 0, 4 * S))
    accountant = EnergyAccountant(sampler, clock=lambda: 10 * S, start_ns=0)
    accountant.report_step(StepTokens(1 * S, 2 * S, {"a": (30, 20)}))
    registry = new_registry()
    register_energy_metrics(registry, sampler, accountant)
    return registry


def test_energy_tokens_and_tokens_per_joule_are_exported():
    text = render(_registry()).decode()
    assert 'o3edge_energy_joules_total{domain="gpu0",meter="scripted"} 200.0' in text
    assert 'o3edge_tokens_total{kind="generated"} 20.0' in text
    assert 'o3edge_tokens_total{kind="prompt"} 30.0' in text
    assert 'o3edge_tokens_per_joule{is_estimate="false",scope="active",window="all"} 0.4' in text
    assert 'o3edge_tokens_per_joule{is_estimate="false",scope="with_idle",window="all"} 0.1' in text
    assert 'o3edge_energy_attributed_joules{kind="idle"} 150.0' in text
    assert 'o3edge_energy_meter_info{domains="gpu0",is_estimate="false",meter="scripted"} 1.0' in text


def test_textfile_is_written_whole_or_not_at_all(tmp_path):
    registry = _registry()
    path = tmp_path / "o3edge.prom"
    assert write_textfile(registry, path)
    assert "o3edge_tokens_per_joule" in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["o3edge.prom"]  # no temporary file left behind
    assert write_textfile(registry, tmp_path / "missing-dir" / "o3edge.prom") is False
