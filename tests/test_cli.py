"""The script contract's parser, in-process: precedence, --help from field docstrings, one-line errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mlsys import cli, report


@dataclass
class Demo(cli.DistArgs, cli.PlotArgs):
    size: int = 100
    """Elements per tensor."""
    mode: Literal["fast", "slow"] = "fast"
    """How to run."""
    sizes: list[int] = field(default_factory=lambda: [1])
    """Several sizes."""

    def validate(self) -> None:
        if self.size % self.world_size:
            raise cli.UsageError(f"--size {self.size} is not divisible by the world size {self.world_size}")


def parse(argv: list[str], **kw) -> Demo:
    return cli.parse(Demo, "demo doc", argv=argv, **kw)


def test_defaults_then_smoke_then_explicit_flags(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parse([]).size == 100
    assert parse(["--smoke"], smoke={"size": 4}).size == 4
    assert parse(["--smoke", "--size", "8"], smoke={"size": 4}).size == 8  # the user's flag wins over the preset
    args = parse(["-w", "4", "--mode", "slow", "--sizes", "1", "2", "--seed", "3"])
    assert (args.world_size, args.mode, args.sizes, args.seed, args.backend) == (4, "slow", [1, 2], 3, "gloo")


def test_help_comes_from_field_docstrings(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("demo doc", "Elements per tensor. (default: 100)", "--world-size", "-w", "{fast,slow}",
                 "--plot-dir", "--smoke", "--json", "--seed", "--backend"):
        assert text in out


@pytest.mark.parametrize("argv, message", [
    (["-w", "0"], "--world-size must be at least 1, got 0"),
    (["--size", "10", "-w", "3"], "--size 10 is not divisible by the world size 3"),
    (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
    (["--size", "ten"], "argument --size: invalid int value: 'ten'"),
    (["--nope"], "unrecognized arguments: --nope"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--seed", "-1"], "--seed must be in 0..2**32-1, got -1"),
])
def test_bad_values_exit_2_with_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_supported_world_sizes_are_enforced(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["-w", "3", "--size", "6"], world_sizes=[1, 2, 4], world_sizes_text="1, 2 or 4")
    assert "supports world sizes 1, 2 or 4, got 3" in capsys.readouterr().err


def test_torchrun_world_size_wins_and_mismatch_is_an_error(monkeypatch, capsys) -> None:
    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="x", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    assert parse([]).world_size == 2
    with pytest.raises(SystemExit):
        parse(["-w", "4"])
    assert "disagrees with torchrun's WORLD_SIZE=2" in capsys.readouterr().err


def test_run_maps_outcomes_to_exit_codes(capsys) -> None:
    def raiser(exc: Exception):
        def main() -> int:
            raise exc
        return main

    for exc, code in [(cli.UsageError("bad"), 2), (cli.SelfCheckFailed("wrong"), 1)]:
        with pytest.raises(SystemExit) as info:
            cli.run(raiser(exc))
        assert info.value.code == code
    with pytest.raises(SystemExit) as info:
        cli.run(lambda: 0)
    assert info.value.code == 0
    assert "SELF-CHECK FAILED: wrong" in capsys.readouterr().err


def test_report_checks_and_table() -> None:
    report.expect_close("x", [1.0, 2.0], [1.0, 2.0 + 1e-9])
    with pytest.raises(cli.SelfCheckFailed, match="max abs error"):
        report.expect_close("x", [1.0], [1.1])
    with pytest.raises(cli.SelfCheckFailed, match="got \\[1\\], expected \\[2\\]"):
        report.expect_equal("y", [1], [2])
    text = report.table([{"name": "a", "ms": 1.5}, {"name": "bbb", "ms": 10.25}])
    assert text.splitlines() == ["name     ms", "----  -----", "a       1.5", "bbb   10.25"]
