"""Hypothesis draws fresh examples on a developer's machine (to find new bugs) and a fixed set in CI (CI=true), so
a CI verdict does not depend on the luck of the draw."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
