"""The energy log: one JSON line per finished request, rotated by size; write failures never stop serving."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from pathlib import Path

from o3edge.power.records import RequestEnergy

log = logging.getLogger(__name__)


def rotated_paths(path: str | Path, backups: int) -> list[Path]:
    """The log and its backups, newest first: log, log.1, ..., log.N."""
    path = Path(path)
    return [path] + [path.with_name(f"{path.name}.{i}") for i in range(1, backups + 1)]


class EnergyLog:
    """Appends JSON lines to `path`; past `max_bytes` it shifts path -> path.1 -> ... -> path.<backups>."""

    def __init__(self, path: str | Path, max_bytes: int = 10 * 1024 * 1024, backups: int = 5):
        if max_bytes <= 0 or backups < 0:
            raise ValueError(f"need max_bytes > 0 and backups >= 0, got {max_bytes}, {backups}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._failing = False
        self.num_failed_writes = 0

    def log_request(self, energy: RequestEnergy, priority: str | int | None = None,
                    prompt_tokens: int | None = None, completion_tokens: int | None = None,
                    finish_reason: str | None = None) -> bool:
        """Write one request's line; token counts default to the accountant's. False if it was not written."""
        now = time.time()
        record = {
            "time": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "ts": round(now, 3),
            "request_id": energy.request_id,
            "priority": priority,
            "prompt_tokens": energy.prompt_tokens if prompt_tokens is None else prompt_tokens,
            "completion_tokens": energy.tokens if completion_tokens is None else completion_tokens,
            "joules": round(energy.joules, 6),
            "tokens_per_joule": None if energy.tokens_per_joule is None else round(energy.tokens_per_joule, 6),
            "duration_s": round(energy.duration_s, 6),
            "meter": energy.meter,
            "domains": list(energy.domains),
            "is_estimate": energy.is_estimate,
            "low_confidence": energy.low_confidence,
        }
        if finish_reason is not None:  # "stop", "length", or the error code the request ended with
            record["finish_reason"] = finish_reason
        return self.write(record)

    def write(self, record: dict) -> bool:
        """Append one record as a JSON line; never raises (the first failure is logged, then one per recovery)."""
        try:
            line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        except (TypeError, ValueError) as exc:
            log.warning("energy log record not serialisable (%s): %r", exc, record)
            return False
        data = line.encode()
        with self._lock:
            try:
                self._rotate_if_needed(len(data))
                with open(self.path, "ab") as f:
                    f.write(data)
            except OSError as exc:
                self.num_failed_writes += 1
                if not self._failing:
                    self._failing = True
                    log.warning("energy log %s cannot be written (%s); serving goes on without it", self.path, exc)
                return False
            if self._failing:
                self._failing = False
                log.info("energy log %s writable again after %d failed writes", self.path, self.num_failed_writes)
            return True

    def _rotate_if_needed(self, incoming: int) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return
        if not os.path.isfile(self.path) or st.st_size == 0 or st.st_size + incoming <= self.max_bytes:
            return  # never rotate a device or pipe someone pointed us at
        paths = rotated_paths(self.path, self.backups)
        if self.backups == 0:
            os.truncate(self.path, 0)
            return
        for i in range(self.backups, 0, -1):  # log.N-1 -> log.N, ..., log -> log.1
            if paths[i - 1].exists():
                os.replace(paths[i - 1], paths[i])
