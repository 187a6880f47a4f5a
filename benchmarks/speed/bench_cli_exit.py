"""The `hpcinfer` program's end (hpcinfer/cli/entry.py) against the interpreter's own, side by side.

The same small job, `run` over `--rows` rows of sample_data on the default model, as a fresh process
each time, rounds interleaved: `python -m hpcinfer` (threads joined, atexit run, streams flushed,
then `os._exit`) against the same command line ending through `SystemExit` and the interpreter's
teardown of every module (`python -c "from hpcinfer.cli import main; main()"`). Prints each form's
median wall and CPU seconds, the ratio, and whether the outputs are the same bytes.

    python benchmarks/speed/bench_cli_exit.py [--rows 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_line  # noqa: E402

FORMS = {
    "hpcinfer's end": [sys.executable, "-m", "hpcinfer"],
    "interpreter's teardown": [
        sys.executable,
        "-c",
        "import sys; sys.argv[0] = 'hpcinfer'; from hpcinfer.cli import main; main()",
    ],
}


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one whole process: its start to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(cpu_line(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as folder:
        rows = pq.read_table(REPO / "sample_data" / "requests.parquet").slice(0, args.rows)
        data = Path(folder) / "rows.parquet"
        pq.write_table(rows, data)
        times: dict[str, list[tuple[float, float]]] = {form: [] for form in FORMS}
        outputs = {form: Path(folder) / f"out{i}.parquet" for i, form in enumerate(FORMS)}
        for _ in range(args.rounds):
            for form, head in FORMS.items():
                times[form].append(timed([*head, "run", str(data), "-o", str(outputs[form]), "--overwrite", "-q"]))
        same = outputs["hpcinfer's end"].read_bytes() == outputs["interpreter's teardown"].read_bytes()
    medians = {form: tuple(map(statistics.median, zip(*t, strict=True))) for form, t in times.items()}
    for form, (wall, cpu) in medians.items():
        print(f"{form:24s} wall {wall:.2f} s  cpu {cpu:.2f} s  (median of {args.rounds})")
    (new_wall, new_cpu), (old_wall, old_cpu) = medians.values()
    print(f"ratio: wall {old_wall / new_wall:.2f}x, cpu {old_cpu / new_cpu:.2f}x; outputs the same bytes: {same}")


if __name__ == "__main__":
    main()
