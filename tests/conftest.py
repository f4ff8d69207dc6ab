"""Hypothesis profiles for the whole test suite, and the checkout kept out of every test's way.

"ci" (chosen when the environment variable CI is "true" or "1"): derandomized, so every run checks the
same examples and a failure reproduces; "dev" (otherwise): fresh random examples each run, which finds
new failures over time (pytest --hypothesis-seed=N replays one). Both: no deadline, 60 examples.

Each test runs in a folder of its own (its tmp_path), so that no relative path (train.py's --out
runs/default) reaches the checkout's runs/, where a user keeps the runs the README made; the session fails
if a test changed anything there.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=60,
                          print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("true", "1") else "dev")

RUNS = Path(__file__).resolve().parent.parent / "runs"


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: its size and modification time."""
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*")
            if path.is_file()}


@pytest.fixture(autouse=True)
def away_from_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session", autouse=True)
def the_checkout_s_runs_stay_as_they_were():
    before = listing(RUNS)
    yield
    changed = sorted(set(before.items()) ^ set(listing(RUNS).items()))
    assert not changed, f"tests changed the checkout's runs/: {[path for path, _ in changed][:5]}"
