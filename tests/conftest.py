"""Hypothesis profiles for the property tests.

- `ci` (the default): derandomized, so a commit's test run is the same on every machine and every run: a failure is
  the code's, reproducible with the same command, never a draw of the random search.
- `explore`: a fresh random search on every run (each test keeps its own number of examples), to look for new failing
  cases on purpose: `HYPOTHESIS_PROFILE=explore pytest -q tests`, a few times. A case it finds is kept as a
  deterministic test (a fixed example or an exhaustive sweep) before the fix.
"""
import os

from hypothesis import settings

settings.register_profile('ci', derandomize=True, print_blob=True)
settings.register_profile('explore', derandomize=False, print_blob=True)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'ci'))
