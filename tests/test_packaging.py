"""The lower layers install only inside ragged_optim: never as top-level `comm`, `kernels` or `sharding`."""

import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])


def _resolve(name: str, cwd) -> str:
    code = f"import importlib.util as u; s = u.find_spec({name!r}); print(s.origin if s else 'None')"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_layers_are_not_top_level_packages(tmp_path):
    for name in ("comm", "kernels", "sharding"):
        origin = _resolve(name, tmp_path).strip()
        # Not found at all, or some other installed package of that name: never our folder.
        assert origin == "None" or not origin.startswith(REPO), (name, origin)


def test_layers_import_under_ragged_optim(tmp_path):
    for name in ("ragged_optim.comm", "ragged_optim.kernels", "ragged_optim.sharding"):
        origin = _resolve(name, tmp_path).strip()
        assert origin.endswith(name.split(".")[1] + "/__init__.py"), (name, origin)
