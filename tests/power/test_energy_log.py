import json
import logging
import os

import pytest

from o3edge.power.energy_log import EnergyLog
from o3edge.power.records import RequestEnergy


def _energy(request_id: str, joules: float = 2.0, tokens: int = 10) -> RequestEnergy:
    return RequestEnergy(request_id, joules, tokens, 5, tokens / joules, 0.5, ("gpu0",), "nvml", False, False)


def test_one_json_line_per_request(tmp_path):
    log = EnergyLog(tmp_path / "logs" / "energy.jsonl")
    assert log.log_request(_energy("r1"), priority="interactive")
    assert log.log_request(_energy("r2", joules=4.0), priority=1, prompt_tokens=7, completion_tokens=9)
    lines = [json.loads(line) for line in (tmp_path / "logs" / "energy.jsonl").read_text().splitlines()]
    assert [r["request_id"] for r in lines] == ["r1", "r2"]
    first = lines[0]
    assert first["priority"] == "interactive" and first["joules"] == 2.0 and first["tokens_per_joule"] == 5.0
    assert (first["prompt_tokens"], first["completion_tokens"]) == (5, 10)
    assert first["meter"] == "nvml" and first["domains"] == ["gpu0"] and first["low_confidence"] is False
    assert first["time"].endswith("+00:00") and isinstance(first["ts"], float)
    assert (lines[1]["prompt_tokens"], lines[1]["completion_tokens"]) == (7, 9)


def test_rotation_by_size_keeps_the_backups_asked_for(tmp_path):
    path = tmp_path / "energy.jsonl"
    log = EnergyLog(path, max_bytes=1000, backups=2)
    for i in range(60):
        assert log.log_request(_energy(f"request-{i:03d}"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["energy.jsonl", "energy.jsonl.1", "energy.jsonl.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    newest = [json.loads(line)["request_id"] for line in path.read_text().splitlines()]
    assert newest[-1] == "request-059"
    older = [json.loads(line)["request_id"] for line in (tmp_path / "energy.jsonl.1").read_text().splitlines()]
    assert older[-1] < newest[0]


def test_unwritable_location_never_raises_and_logs_once(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be")
    log = EnergyLog(blocker / "energy.jsonl")
    with caplog.at_level(logging.WARNING, logger="o3edge.power.energy_log"):
        for i in range(3):
            assert log.log_request(_energy(f"r{i}")) is False
    assert caplog.text.count("cannot be written") == 1
    assert log.num_failed_writes == 3


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_never_raises(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        assert EnergyLog(directory / "energy.jsonl").log_request(_energy("r1")) is False
    finally:
        directory.chmod(0o700)


def test_writes_resume_when_the_location_comes_back(tmp_path, caplog):
    blocker = tmp_path / "logs"
    blocker.write_text("")
    log = EnergyLog(blocker / "energy.jsonl")
    assert not log.log_request(_energy("lost"))
    blocker.unlink()
    with caplog.at_level(logging.INFO, logger="o3edge.power.energy_log"):
        assert log.log_request(_energy("kept"))
    assert "writable again" in caplog.text
