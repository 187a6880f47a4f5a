"""The option table: one declaration per option, its default the config's, the config built from it."""

from __future__ import annotations

import click

from hpcinfer.cli import main
from hpcinfer.cli.declare import SECTIONS
from hpcinfer.cli.options import build_run_config, build_tune_options, declared
from hpcinfer.config import InputConfig, OutputConfig, RunConfig
from hpcinfer.tune.options import TuneOptions


def parsed(command: str, *argv: str) -> dict:
    cmd = main.commands[command]
    return cmd.make_context(command, list(argv)).params


def test_no_flags_build_the_config_defaults():
    got = build_run_config(parsed("run", "in.jsonl", "-o", "out.parquet"), "run")
    assert got == RunConfig(input=InputConfig(("in.jsonl",)), output=OutputConfig("out.parquet"))
    assert build_tune_options(parsed("tune", "in.jsonl")) == TuneOptions()


def test_every_flag_reaches_its_field():
    argv = ["a.jsonl", "b.jsonl", "-o", "o.jsonl", "--sort-window", "7", "--no-prefix-cache", "--stop", "x"]
    argv += ["--stop", "y", "--seed", "3", "--max-rejects", "1%", "--dtype", "float16", "--engine", "ray"]
    got = build_run_config(parsed("run", *argv), "run")
    assert got.input.paths == ("a.jsonl", "b.jsonl") and got.output.path == "o.jsonl"
    assert got.plan.sort_window == 7 and got.generate.prefix_cache is False
    assert got.generate.stop == ("x", "y") and got.generate.seed == 3
    assert (got.output.max_rejects, got.output.max_reject_fraction) == (None, 0.01)
    assert got.device.dtype == "float16" and got.cluster.engine == "ray"


def test_tune_seeds_the_sample_with_sample_seed_and_generation_with_seed():
    values = parsed("tune", "in.jsonl", "--sample-seed", "5", "--seed", "9", "--sample", "40")
    assert build_tune_options(values).sample_seed == 5 and build_tune_options(values).sample_rows == 40
    assert build_run_config(values, "tune").generate.seed == 9


def test_one_declaration_per_flag_and_a_known_section_each():
    for command in ("run", "profile", "tune"):
        flags = [f for o in declared(command) for f in o.flags]
        assert len(flags) == len(set(flags)), command
        assert {o.section for o in declared(command)} <= set(SECTIONS)


def test_help_is_printed_in_sections_in_order():
    ctx = click.Context(main.commands["run"], info_name="run")
    text = main.commands["run"].get_help(ctx)
    heads = [line.rstrip(":") for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    wanted = [s for s in SECTIONS if s in heads]
    assert heads[: len(wanted)] == wanted
    assert {"Input", "Output", "Model and task", "Embedding", "Generation", "Devices", "Cluster", "Reports"} <= set(
        heads
    )
    assert "Embed every row" not in text
