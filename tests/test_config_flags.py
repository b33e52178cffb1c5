"""The command-line options come from TrainConfig itself: one text per field, one small rename table."""

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gpunb.config import TrainConfig, setting
from gpunb.config_flags import (RENAMED, add_config_flags, as_flag_hints, config_flags, config_values,
                                flag_of, parse_config)

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"
# functions, and `slurm`, a mapping the magic gathers from --partition, --time, ... and --slurm KEY=VALUE
SET_IN_PYTHON = {"transforms", "batch_size_fn", "slurm", "sweep"}


def parse(argv, config_class=TrainConfig) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_config_flags(parser, config_class)
    return config_values(parser.parse_args(argv), config_class)


def test_every_field_has_help_and_every_field_a_command_line_can_hold_is_a_flag():
    fields = dataclasses.fields(TrainConfig)
    assert all(f.metadata.get("help") for f in fields), [f.name for f in fields if not f.metadata.get("help")]
    flagged = {flag.field for flag in config_flags()}
    assert flagged == {f.name for f in fields} - SET_IN_PYTHON
    assert all(flag.help and flag.section for flag in config_flags())


def test_every_flag_is_in_the_magics_help_with_its_text():
    from gpunb.notebook.magics import GpuMagics

    doc = " ".join(GpuMagics.gputrain.__doc__.split())  # argparse wraps the lines
    for flag in config_flags():
        assert all(spelling in doc for spelling in flag.spellings), flag
        assert " ".join(flag.help.split()[:4]) in doc, flag
    assert "how long (TrainConfig):" in doc and "checkpoints (TrainConfig):" in doc  # grouped by section


def test_a_new_field_is_a_flag_with_its_help_and_no_other_edit():
    @dataclasses.dataclass
    class Scratch(TrainConfig):
        label_smoothing: float = setting(0.0, "spread this much of each target's weight over the other classes")
        tag: str | None = setting(None, "a word kept with the run", section="bookkeeping")

    flags = {flag.field: flag for flag in config_flags(Scratch)}
    assert flags["label_smoothing"].spellings == ("--label-smoothing",)
    assert flags["label_smoothing"].help.startswith("spread this much")
    assert flags["tag"].section == "bookkeeping"
    config = parse_config(["--label-smoothing", "0.1", "--tag", "baseline", "--epochs", "2"], Scratch())
    assert (config.label_smoothing, config.tag, config.epochs) == (0.1, "baseline", 2)
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Scratch)
    assert "spread this much of each target's weight" in " ".join(parser.format_help().split())


def test_help_is_written_once_in_the_package():
    """The field's help lives in config.py; no front end that declares options repeats it (the magic used to)."""
    front_ends = [*(PACKAGE / "notebook").glob("*.py"), PACKAGE / "cli.py", PACKAGE / "demo.py",
                  PACKAGE / "config_flags.py"]
    sources = {path: path.read_text() for path in front_ends}
    for flag in config_flags():
        opening = flag.help[:40]
        assert not [p.name for p, text in sources.items() if opening in text], flag.field
    magics = (PACKAGE / "notebook" / "magics.py").read_text()
    for flag in config_flags():
        assert f'"{flag.spellings[0]}"' not in magics, f"{flag.spellings[0]} is declared by hand in magics.py"


@pytest.mark.parametrize("argv, expected", [
    (["--clip", "1.0"], {"clip_grad_norm": 1.0}),
    (["--clip-grad-norm", "1.0"], {"clip_grad_norm": 1.0}),
    (["--log", "csv,tb"], {"loggers": "csv,tb"}),
    (["--checkpointing"], {"activation_checkpointing": True}),
    (["--no-track"], {"track": False}),
    (["--no-shuffle", "--drop-last"], {"shuffle": False, "drop_last": True}),
    (["--compile"], {"compile": True}),
    (["--compile", "off"], {"compile": False}),
    (["--compile", "reduce-overhead"], {"compile": "reduce-overhead"}),
    (["--gpu-resident", "false"], {"gpu_resident": False}),
    (["--resume"], {"resume": True}),
    (["--resume", "best"], {"resume": "best"}),
    (["--batch-size", "auto", "--devices", "2", "--log-every", "10"], {"batch_size": "auto", "devices": 2,
                                                                       "log_every": 10}),
    ([], {}),
])
def test_flags_give_the_values_trainconfig_takes(argv, expected):
    values = parse(argv)
    assert values == expected
    TrainConfig(**values, **({"checkpoint_dir": "x"} if "resume" in values else {}))  # and it takes them


def test_the_renamed_flags_are_few_and_name_real_fields():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(RENAMED) <= names and len(RENAMED) <= 5
    assert flag_of("clip_grad_norm") == "--clip" and flag_of("max_steps") == "--max-steps"


def test_config_errors_name_the_flag_that_fixes_them():
    assert as_flag_hints("pass e.g. `batch_size=64` or `clip_grad_norm=1.0`.") == \
        "pass e.g. `--batch-size 64` or `--clip 1.0`."
    assert as_flag_hints("pass `batch_size='auto'`.") == "pass `--batch-size auto`."
    assert as_flag_hints("pass e.g. `loss_fn=torch.nn.CrossEntropyLoss()`.") == \
        "pass e.g. `loss_fn=torch.nn.CrossEntropyLoss()`."  # not a config field: left alone


def test_an_exported_script_takes_the_same_flags(tmp_path):
    from gpunb.notebook.export import export_script

    cell = ("import torch\nfrom torch import nn\nmodel = nn.Linear(4, 2)\n"
            "train_data = (torch.randn(16, 4), torch.randint(0, 2, (16,)))\nloss_fn = nn.CrossEntropyLoss()")
    script = export_script(tmp_path / "train.py", cell, TrainConfig(epochs=2, batch_size=8))
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False, env=None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--max-steps" in done.stdout and "--clip" in done.stdout
    config = parse_config(["--epochs", "5"], TrainConfig(epochs=2, batch_size=8))
    assert (config.epochs, config.batch_size) == (5, 8)  # what the script does with its command line


def test_only_one_place_turns_gpunb_errors_into_usage_errors():
    """notebook/options.py's usage_errors; no other handler of a GpunbError raises a UsageError."""
    converting = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and "GpunbError" in ast.unparse(node.type or ast.Name("")):
                if "UsageError(" in "".join(ast.unparse(statement) for statement in node.body):
                    converting.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert len(converting) == 1 and converting[0].startswith("notebook/options.py:"), converting


def test_a_hint_becomes_a_flag_only_where_a_flag_exists():
    assert as_flag_hints("pass `memory_plan=False` or `restore_best=True`.") == \
        "pass `--no-memory-plan` or `--restore-best`."
    assert as_flag_hints("pass `batch_size_fn=f`.") == "pass `batch_size_fn=f`."  # set in Python only
    assert as_flag_hints("pass `loggers='tensorboard,csv'`.") == "pass `--log tensorboard,csv`."
    several = "shard over more GPUs (`devices=N, strategy='fsdp'`)"
    assert as_flag_hints(several) == several  # one span, two settings: left whole
