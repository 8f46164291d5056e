"""Hypothesis draws fresh examples on a developer's machine (to find new bugs) and a fixed set in CI (CI=true), so
a CI verdict does not depend on the luck of the draw."""

import os
import sys
from pathlib import Path

from hypothesis import settings

# `python -m pytest` (what `./dev test` runs) puts the working folder first on sys.path. From the repo root that
# makes our `kernels/` folder importable as a top-level `kernels`, shadowing the PyPI package of that name which
# transformers imports (`ImportError: cannot import name 'CUDAProperties' from 'kernels'`). Our layers import only
# as ragged_optim.*, so the root has no business on the path; forked ranks inherit the cleaned path.
_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _REPO_ROOT]

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

if os.environ.get("RO_TEST_BUCKET_BYTES"):  # run the suite with every unit's grads in small buckets (a stress run)
    from ragged_optim.sharding import grad_buckets

    grad_buckets.BUCKET_BYTES = int(os.environ["RO_TEST_BUCKET_BYTES"])
    grad_buckets.ONLY_AT_PEAK = False
