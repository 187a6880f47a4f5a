"""What `hpcinfer tune` shows while it works: the sample, a live table of trials, the verdict."""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..tune.options import TuneOptions


def show_tuning(base: RunConfig, options: TuneOptions, opts: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.live import Live

    from ..tune.command import tune as run_tune
    from ..tune.render import trial_line, trial_table, verdict

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: room for the whole trial table
        console = Console(stderr=True, width=160)
    live_table = console.is_terminal and not opts["quiet"]

    def on_sample(sample: Any) -> None:
        if not opts["quiet"]:
            console.print(f"sample: {sample.describe()}", highlight=False)

    with Live(console=console, auto_refresh=False, transient=False) if live_table else _Nothing() as live:

        def on_trial(search: Any, trial: Any, status: str) -> None:
            if live is not None:
                live.update(trial_table(search, status), refresh=True)
            elif trial is not None and not opts["quiet"]:
                console.print(trial_line(search, trial), highlight=False)

        result = run_tune(base, options, on_sample, on_trial)
        if live is not None:
            live.update(trial_table(result.search), refresh=True)
    if not live_table and not opts["quiet"]:
        console.print(trial_table(result.search))
    for line in verdict(result.search):
        console.print(line, highlight=False)
    if options.recipe_path:
        console.print(f"recipe written: {options.recipe_path} (hpcinfer run --config {options.recipe_path} ...)")
    if options.trials_csv:
        console.print(f"trials written: {options.trials_csv}")


class _Nothing:
    """A context manager standing in for Live when there is no terminal."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
