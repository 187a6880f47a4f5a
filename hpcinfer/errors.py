"""Typed errors. User errors are rendered once by the CLI as one line, with an exit code."""

from __future__ import annotations


class HpcinferError(Exception):
    """A problem the user can fix (bad path, unknown column, ...). Rendered without a traceback."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path, self.reason = path, message
        super().__init__(f"{path}: {message}" if path else message)


class InputError(HpcinferError):
    """An input file is missing, unreadable or lacks a required column."""


class OutputError(HpcinferError):
    """The output cannot be written (exists, unwritable directory, full disk)."""


class ModelError(HpcinferError):
    """The model directory is missing files or describes an unsupported architecture."""


class UnsupportedModel(ModelError):
    """A checkpoint hpcinfer has no native model for (its architecture, activation, RoPE type):
    `--backend auto` runs it on the transformers path instead, `--backend native` refuses it."""


class ConfigError(HpcinferError):
    """An option value or a recipe key is invalid."""


class Interrupted(HpcinferError):
    """SIGINT/SIGTERM: committed windows are kept; the run can be resumed."""

    def __init__(self, signum: int, rows_done: int, output: str) -> None:
        self.signum = signum  # 0: stopped by its caller (api.run's `stop`)
        self.rows_done = rows_done
        self.exit_code = 128 + signum
        super().__init__(f"{'interrupted' if signum else 'stopped'}: {rows_done:,} rows are committed", path=output)


class StageError(Exception):
    """An unexpected failure inside a pipeline stage, carrying the stage name.

    NOTE: user errors raised inside a stage keep their own type; this wraps everything else so the
    run can say which stage failed.
    """

    exit_code = 1

    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        self.cause = cause
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}: {cause}")


class DeviceResultFailed(RuntimeError):
    """A device's failure, raised where a stage off the device (the writer) awaited its result:
    it counts against device `replica` (its index in the run's devices), whichever stage saw it."""

    def __init__(self, replica: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.replica = replica


class DeviceHung(RuntimeError):
    """A device stopped returning results within --step-timeout (a fault, as an error would be)."""


class DevicesFailed(StageError):
    """Every device of a run failed (each one's circuit breaker is open): the run cannot go on."""

    def __init__(self, failures: dict[str, str], cause: BaseException) -> None:
        super().__init__(", ".join(failures), cause)
        each = "; ".join(f"{stage}: {error}" for stage, error in failures.items())
        self.args = (f"every device failed: {each}",)

    def __str__(self) -> str:
        return str(self.args[0])
