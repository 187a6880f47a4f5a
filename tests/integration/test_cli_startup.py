"""The command line answers at once: --help, --version and argument errors import no torch or pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import SAMPLE_JSONL

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
HEAVY = ("torch", "pyarrow", "numpy", "rich", "tokenizers")

# Runs the CLI in-process with the given arguments, then prints which heavy modules got imported.
PROBE = """
import json, sys
import hpcinfer.cli.entry  # the installed program's module (`hpcinfer`, `python -m hpcinfer`)
from hpcinfer.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
except BaseException:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["run", "--help"], ["profile", "--help"], ["tune", "--help"], ["run"], ["run", "x"]],
    ids=lambda a: " ".join(a),
)
def test_help_version_and_argument_errors_import_nothing_heavy(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, env=ENV, timeout=60
    )
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == [], f"hpcinfer {' '.join(argv)} imported {imported}"


def test_profile_needs_no_output_and_leaves_none(tmp_path, tiny_model):
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "profile", str(SAMPLE_JSONL), "--limit", "100", "--model", str(tiny_model)],
        capture_output=True,
        text=True,
        env={**ENV, "TMPDIR": str(tmp_path), "COLUMNS": "200"},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "100 read = 100 written + 0 rejected + 0 resumed" in done.stderr
    trace = json.loads((tmp_path / "hpcinfer-trace.json").read_text())
    assert trace["traceEvents"]
    left = sorted(p.name for p in Path(tmp_path).iterdir() if not p.name.startswith("torchinductor"))
    assert left == ["hpcinfer-trace.json"], f"the temporary output was not removed: {left}"
