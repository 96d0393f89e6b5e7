"""memory.Trimmer: when the daemon gives heap memory back after big inputs (glibc's malloc_trim, called for real)."""

from o3edge import memory


def test_a_trim_made_while_requests_are_in_flight_is_followed_by_one_once_they_are_done(monkeypatch):
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 0.0)
    t = memory.Trimmer()
    t.note(100)
    t.maybe_trim()
    assert t.num_trims == 0  # small inputs: not worth a trim
    t.note(2 << 20)
    t.maybe_trim(busy=True)
    assert t.num_trims == 1
    t.maybe_trim(busy=True)
    assert t.num_trims == 1  # the big request is still being worked on: its memory is not free yet
    t.maybe_trim(busy=False)
    assert t.num_trims == 2  # done: what it held goes back too
    t.maybe_trim(busy=False)
    assert t.num_trims == 2  # and nothing more until the next big input


def test_trims_are_spaced(monkeypatch):
    monkeypatch.setattr(memory, "TRIM_EVERY_S", 3600.0)
    t = memory.Trimmer()
    t.note(2 << 20)
    t.maybe_trim()
    t.note(2 << 20)
    t.maybe_trim()
    assert t.num_trims == 1
