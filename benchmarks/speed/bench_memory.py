"""Memory benchmark: peak RSS of `hpcinfer run` must not grow with the input size.

Generates JSONL request files of several sizes, embeds each with a tiny random BERT (so the run is
bound by reading, tokenizing and writing rather than by compute) in a fresh `hpcinfer run`
process, checks the output (row count, ids in input order) and compares the peak resident set
size of the runs.

    python benchmarks/speed/bench_memory.py                       # 250k and 1M rows
    python benchmarks/speed/bench_memory.py --rows 20000,80000 --workdir /tmp/bm --keep
    python benchmarks/speed/bench_memory.py --hpcinfer-args "--sort-window 20000 --tokenize-threads 2"

PASS when the peak RSS at the largest size is under --max-rss-mib and within --tolerance of the
peak at the smallest size; FAIL (exit code 1) otherwise, or when an output is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

TIME_BIN = "/usr/bin/time"
CHUNK_ROWS = 50_000

# A small fixed vocabulary; a few entries carry punctuation so the text is not just bare words.
_VOCAB_TEXT = """
    the of and to in a is that for it as was with be by on not he this are or his from at which but have an they
    you were her she there one all we their been has when who will more no if out so said what up its about into
    than them can only other new some could time these two may then do first any my now such like our over man me
    even most made after also did many before must through back years where much your way well down should because
    each just those people how too little state good very make world still own see men work long get here between
    both life being under never day same another know while last might us great old year off come since against go
    came right used take three system data model batch memory token window stream file output input order query
    result value table index cluster server network vector embedding research paper city river market music garden
    history science water light small large early late open close simple quick bright quiet ancient modern however,
    therefore, meanwhile, indeed, perhaps, finally, although, because, report; result; example: note:
"""
VOCAB: tuple[str, ...] = tuple(_VOCAB_TEXT.split())


def default_hpcinfer() -> list[str]:
    """The `hpcinfer` console script of this interpreter's environment, else `python -m hpcinfer`."""
    script = Path(sys.executable).parent / "hpcinfer"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("hpcinfer")
    return [found] if found else [sys.executable, "-m", "hpcinfer"]


def row_id(i: int) -> str:
    return f"r-{i:07d}"


def generate_jsonl(path: Path, rows: int, seed: int, min_words: int = 5, max_words: int = 120) -> float:
    """Writes `rows` lines {"id": "r-0000001", "text": "..."}; returns the seconds it took.

    Words are sampled with a Zipf-like weighting from VOCAB (plain ASCII, no quotes or backslashes,
    so no JSON escaping is needed); each text starts with a capital and ends with a period.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(VOCAB) + 1) ** 0.8
    weights /= weights.sum()
    vocab = np.array(VOCAB, dtype=object)
    capitals = np.array([w[:1].upper() + w[1:] for w in VOCAB], dtype=object)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            lengths = rng.integers(min_words, max_words + 1, size=n)
            choice = rng.choice(len(VOCAB), size=int(lengths.sum()), p=weights)
            words = vocab[choice]
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            words[offsets[:-1]] = capitals[choice[offsets[:-1]]]
            flat = words.tolist()
            bounds = offsets.tolist()
            lines = [
                f'{{"id": "{row_id(start + k + 1)}", "text": "{" ".join(flat[bounds[k] : bounds[k + 1]])}."}}\n'
                for k in range(n)
            ]
            fh.writelines(lines)
    return time.perf_counter() - t0


@dataclass
class RunResult:
    rows: int
    wall_s: float
    peak_rss_mib: float
    returncode: int
    report: dict
    output_ok: bool
    output_msg: str

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s > 0 else float("nan")


_MAXRSS = re.compile(r"Maximum resident set size \(kbytes\):\s*(\d+)")


def run_measured(cmd: list[str], log_path: Path) -> tuple[int, float, float]:
    """Runs cmd in a fresh process; returns (returncode, wall seconds, peak RSS MiB of that process).

    Uses GNU time's -v when present (the child's own maxrss); otherwise os.wait4 on the child's pid,
    which also reports that one child's rusage, not a maximum over all children so far.
    """
    with open(log_path, "wb") as log:
        if os.path.exists(TIME_BIN):
            time_out = log_path.with_suffix(".time")
            t0 = time.perf_counter()
            proc = subprocess.run([TIME_BIN, "-v", "-o", str(time_out), *cmd], stdout=log, stderr=subprocess.STDOUT)
            wall = time.perf_counter() - t0
            match = _MAXRSS.search(time_out.read_text(encoding="utf-8", errors="replace"))
            if match is None:
                raise RuntimeError(f"no 'Maximum resident set size' in {time_out}")
            return proc.returncode, wall, int(match.group(1)) / 1024
        t0 = time.perf_counter()
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(popen.pid, 0)
        wall = time.perf_counter() - t0
        popen.returncode = os.waitstatus_to_exitcode(status)
        # ru_maxrss is in KiB on Linux (bytes on macOS).
        scale = 1 / (1024 * 1024) if sys.platform == "darwin" else 1 / 1024
        return popen.returncode, wall, usage.ru_maxrss * scale


def verify_output(path: Path, rows: int) -> tuple[bool, str]:
    """Exactly `rows` rows, ids r-0000001.. in input order; reads only the id column."""
    if not path.is_file():
        return False, "no output file"
    ids = pq.read_table(path, columns=["id"]).column("id").combine_chunks()
    if len(ids) != rows:
        return False, f"{len(ids)} output rows for {rows} input rows"
    expected = pa.array([row_id(i) for i in range(1, rows + 1)], type=pa.string())
    if ids.type != pa.string():
        ids = ids.cast(pa.string())
    if not ids.equals(expected):
        mismatch = pc.not_equal(ids, expected).to_numpy(zero_copy_only=False)
        first = int(np.argmax(mismatch))
        return False, f"ids out of order: row {first} is {ids[first].as_py()!r}, expected {expected[first].as_py()!r}"
    return True, "ok"


def parse_rows(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower().replace("_", "")
        if not part:
            continue
        mult = 1
        if part[-1] in "km":
            mult = 1_000 if part[-1] == "k" else 1_000_000
            part = part[:-1]
        sizes.append(int(float(part) * mult))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("--rows needs positive sizes, e.g. 250000,1000000 or 250k,1m")
    return sorted(set(sizes))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=parse_rows, default=parse_rows("250000,1000000"), help="comma-separated sizes")
    p.add_argument("--workdir", type=Path, default=None, help="where inputs/outputs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp workdir (a given --workdir is always kept)")
    p.add_argument("--seed", type=int, default=1234, help="text generation seed")
    p.add_argument("--hpcinfer-args", default="", help='extra `hpcinfer run` arguments, e.g. "--sort-window 20000"')
    p.add_argument("--hpcinfer", default=None, help="command that runs hpcinfer (default: this environment's)")
    p.add_argument("--max-rss-mib", type=float, default=2048.0, help="absolute peak RSS limit at the largest size")
    p.add_argument("--tolerance", type=float, default=0.20, help="allowed peak RSS growth, largest vs smallest")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hpcinfer = shlex.split(args.hpcinfer) if args.hpcinfer else default_hpcinfer()
    extra = shlex.split(args.hpcinfer_args)
    own_tmp = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="bench_memory_")) if own_tmp else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir: {workdir}", flush=True)
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not
        from tests.fixtures.tiny import build_tiny_bert

        tiny = build_tiny_bert(workdir / "tiny", hidden=32, layers=1, heads=2, intermediate=64)
        results: list[RunResult] = []
        for i, rows in enumerate(args.rows):
            src = workdir / f"requests_{rows}.jsonl"
            gen_s = generate_jsonl(src, rows, seed=args.seed + i)
            size_mib = src.stat().st_size / 2**20
            print(f"generated {rows:,} rows ({size_mib:,.1f} MiB) in {gen_s:.1f} s: {src.name}", flush=True)
            out = workdir / f"out_{rows}.parquet"
            report_path = workdir / f"report_{rows}.json"
            cmd = [
                *hpcinfer,
                "run",
                str(src),
                "-o",
                str(out),
                "--model",
                str(tiny),
                "--progress",
                "off",
                "--report",
                str(report_path),
                "--overwrite",
                *extra,
            ]
            print("$ " + shlex.join(cmd), flush=True)
            rc, wall, rss = run_measured(cmd, workdir / f"run_{rows}.log")
            report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
            ok, msg = verify_output(out, rows) if rc == 0 else (False, f"exit code {rc}")
            if rc != 0:
                log_tail = (workdir / f"run_{rows}.log").read_text(encoding="utf-8", errors="replace")[-2000:]
                print(log_tail, file=sys.stderr)
            res = RunResult(rows, wall, rss, rc, report, ok, msg)
            results.append(res)
            print(
                f"  rc={rc} wall={wall:.1f}s peak_rss={rss:,.0f} MiB"
                f" pipeline_wall={report.get('wall_s', float('nan')):.1f}s output: {msg}",
                flush=True,
            )

        print()
        print(f"{'rows':>10} {'wall s':>8} {'rows/s':>9} {'peak RSS MiB':>13}  output")
        for r in results:
            print(f"{r.rows:>10,} {r.wall_s:>8.1f} {r.rows_per_s:>9,.0f} {r.peak_rss_mib:>13,.0f}  {r.output_msg}")
        small, large = results[0], results[-1]
        ratio = large.peak_rss_mib / small.peak_rss_mib if small.peak_rss_mib else float("inf")
        print(f"peak RSS ratio {large.rows:,} / {small.rows:,} rows: {ratio:.3f}")
        failures = [f"{r.rows:,} rows: {r.output_msg}" for r in results if not r.output_ok]
        if large.peak_rss_mib >= args.max_rss_mib:
            failures.append(f"peak RSS {large.peak_rss_mib:,.0f} MiB >= {args.max_rss_mib:,.0f} MiB")
        if ratio > 1 + args.tolerance:
            failures.append(f"peak RSS grew {ratio:.2f}x (> {1 + args.tolerance:.2f}x) from the smallest size")
        if failures:
            print("FAIL: " + "; ".join(failures))
            return 1
        print(f"PASS: peak RSS {large.peak_rss_mib:,.0f} MiB < {args.max_rss_mib:,.0f} MiB, ratio {ratio:.3f}")
        return 0
    finally:
        if own_tmp and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
