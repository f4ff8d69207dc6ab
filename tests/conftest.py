"""Hypothesis profiles for the whole test suite.

"ci" (chosen when the environment variable CI is "true" or "1"): derandomized, so every run checks the
same examples and a failure reproduces; "dev" (otherwise): fresh random examples each run, which finds
new failures over time (pytest --hypothesis-seed=N replays one). Both: no deadline, 60 examples.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=60,
                          print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("true", "1") else "dev")
