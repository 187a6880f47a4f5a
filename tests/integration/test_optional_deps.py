"""Optional packages stay optional: nvtx is needed by `hpcinfer profile` only."""

from __future__ import annotations

import subprocess
import sys

from ..conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

NO_NVTX = "import sys; sys.modules['nvtx'] = None  # as if it were not installed\n"


def test_nvtx_is_an_optional_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not [d for d in project["dependencies"] if d.startswith("nvtx")]
    assert [d for d in project["optional-dependencies"]["profile"] if d.startswith("nvtx")]


def test_every_module_imports_without_nvtx():
    code = NO_NVTX + (
        "import importlib, pkgutil, hpcinfer\n"
        "names = [m.name for m in pkgutil.walk_packages(hpcinfer.__path__, 'hpcinfer.')]\n"
        "names.remove('hpcinfer.__main__')  # it would run the CLI\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 30


def test_profile_without_nvtx_says_how_to_install_it(tmp_path, tiny_model, requests_jsonl):
    code = NO_NVTX + "from hpcinfer.cli.entry import run\nrun()\n"  # the installed program
    argv = ["profile", str(requests_jsonl), "-o", str(tmp_path / "o.parquet"), "--model", str(tiny_model)]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'hpcinfer[profile]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.parquet").exists()
