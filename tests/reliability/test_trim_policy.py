"""memory.Trimmer: when the daemon gives heap memory back after big inputs (glibc's malloc_trim, called for real)."""

from o3edge import memory


def test_big_inputs_are_trimmed_and_once_more_when_the_daemon_is_quiet(monkeypatch):
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 0.0)
    monkeypatch.setattr(memory, "QUIET_S", 0.0)
    t = memory.Trimmer()
    t.note(100)
    t.maybe_trim()
    assert t.num_trims == 0  # small inputs: not worth a trim
    t.note(2 << 20)
    t.maybe_trim(busy=True)
    assert t.num_trims == 1
    t.note(3000)  # a small prompt after it: the memory its serving frees is not covered by that trim
    t.maybe_trim(busy=True)
    assert t.num_trims == 1  # still being worked on
    t.maybe_trim(busy=False)
    assert t.num_trims == 2  # quiet: what the work held goes back too
    t.maybe_trim(busy=False)
    assert t.num_trims == 2  # and nothing more until the next big input


def test_the_follow_up_waits_for_quiet(monkeypatch):
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 0.0)
    monkeypatch.setattr(memory, "QUIET_S", 3600.0)
    t = memory.Trimmer()
    t.note(2 << 20)
    t.maybe_trim()
    t.maybe_trim()
    assert t.num_trims == 1  # input came in just now: requests may still follow and be worked on


def test_trims_are_spaced(monkeypatch):
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 3600.0)
    t = memory.Trimmer()
    t.note(2 << 20)
    t.maybe_trim()
    t.note(2 << 20)
    t.maybe_trim()
    assert t.num_trims == 1


def test_the_first_big_input_is_trimmed_however_recently_the_machine_booted(monkeypatch):
    """An edge box's monotonic clock starts near zero at boot: the first trim must not wait for it to pass
    TRIM_EVERY_S."""
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 3600.0)
    monkeypatch.setattr(memory.time, "monotonic", lambda: 5.0)  # five seconds after a boot
    t = memory.Trimmer()
    t.note(2 << 20)
    t.maybe_trim()
    assert t.num_trims == 1
