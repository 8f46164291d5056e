"""The lower layers install only inside ragged_optim: never as top-level `comm`, `kernels` or `sharding`."""

import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


TOP_LEVEL = ("comm", "kernels", "sharding")
MAPPED = tuple(f"ragged_optim.{n}" for n in TOP_LEVEL)


def test_layers_resolve_only_under_ragged_optim(tmp_path):
    # A fresh interpreter outside the repo, as a user's program or a Jupyter kernel would be.
    code = (
        "import importlib.util as u\n"
        f"for n in {TOP_LEVEL + MAPPED!r}:\n"
        "    s = u.find_spec(n); print(n, s.origin if s else 'None')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    origins = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    for name in TOP_LEVEL:  # not found, or another installed package of that name (ipykernel needs `comm`)
        assert not origins[name].startswith(str(Path(REPO) / name)), (name, origins[name])
    for name in MAPPED:
        assert origins[name].endswith(name.split(".")[1] + "/__init__.py"), (name, origins[name])


def test_every_subpackage_is_listed_for_regular_installs():
    # An editable install finds any folder; a wheel ships only what pyproject lists.
    import tomllib

    listed = set(tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"ragged_optim." + p.parent.name for p in (Path(REPO) / "ragged_optim").glob("*/__init__.py")}
    assert found | {"ragged_optim", *MAPPED} == listed
