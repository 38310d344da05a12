"""``MetricsWatch``: when each record of a run's ``metrics.jsonl`` first appeared, for tests and benchmarks that time
what a job does after a fault (a killed rank, a stopped one, a dead replica group) from the job's own records rather
than from the start of a command, whose interpreters' start-up depends on the machine's load."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MetricsWatch:
    """Polls ``path`` every 20 ms on a thread of its own from construction until ``stop``; ``seen`` holds
    ``(time.monotonic() when first read, record)`` for each complete line, in order."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.seen = Path(path), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = 0
        while True:
            stopping = self._stop.is_set()  # read once more after stop(): a record written just before it counts
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            now = time.monotonic()
            for line in lines[count:]:
                if not line.endswith("}"):  # a line still being written
                    break
                self.seen.append((now, json.loads(line)))
                count += 1
            if stopping:
                return
            self._stop.wait(0.02)

    def first(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> float | None:
        """When the first record that ``match``es appeared, waiting for it up to ``timeout`` s (None: it did not)."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((seen for seen, record in list(self.seen) if match(record)), None)
            if found is not None or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def stop(self) -> list[tuple[float, dict[str, Any]]]:
        """Stop polling (after one last read) and return ``seen``."""
        self._stop.set()
        self._thread.join()
        return self.seen
