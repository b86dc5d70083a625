"""Where an align run's time goes (wall seconds per phase), and progress bars that give an ETA in time.

Calibrating Gemma-3-270M took 15 minutes on 2 busy cores with nothing saying on what; each phase
(calibration passes, activation statistics, SVDs, loss curves, kernel timing, GAC's check,
evaluation) is now timed and reported, and every bar has a total, so tqdm shows the time left.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed} elapsed, {remaining} (min:s) left]"


class Phases:
    """Wall seconds per named phase, summed over every time a phase runs."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds / 60:.2f} min" for name, seconds in self.seconds.items())


def bar(total: int, desc: str, enabled: bool = True, unit: str = "step"):
    """A tqdm bar on stderr with a total, so it shows the time left."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, bar_format=BAR_FORMAT)
