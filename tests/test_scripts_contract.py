"""Every chapter script, discovered automatically: --help, bad flags, and a --smoke run that writes its JSON.

A new script under tutorial/*/*/scripts/ is picked up with no change here, so a script without a working
`--smoke` fails the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import chapter_scripts, run, script_id, smoke_run

SCRIPTS = chapter_scripts()


def test_scripts_exist() -> None:
    assert SCRIPTS, "no chapter scripts found under tutorial/"


@pytest.fixture(scope="session")
def command_lines() -> dict:
    """--help and a bad flag of every script, run in one interpreter (tests/_cli_probe.py): parsing exits before
    any work, so one process that imports torch once stands in for two per script."""
    proc = run([Path(__file__).parent / "_cli_probe.py", *SCRIPTS], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_help_and_bad_flag(script: Path, helped: dict, bad: dict) -> None:
    assert helped["code"] == 0, helped["stderr"]
    for flag in ("--seed", "--smoke", "--json"):
        assert flag in helped["stdout"], f"{script.name} --help does not list {flag}"
    if "--world-size" in helped["stdout"]:
        assert "--backend" in helped["stdout"]
    assert bad["code"] == 2, bad["stdout"] + bad["stderr"]
    assert "Traceback" not in bad["stderr"]
    assert len(bad["stderr"].strip().splitlines()) == 1, f"want a one-line error, got:\n{bad['stderr']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_help_and_bad_flags(script, command_lines) -> None:
    probe = command_lines[str(script)]
    check_help_and_bad_flag(script, probe["help"], probe["bad"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["bare_spawn.py", "hello_distributed.py", "serve.py"])
def test_help_and_bad_flags_in_a_real_process(name) -> None:
    """The same checks with `python script.py`, for a few scripts: the in-process probe above is faithful."""
    (script,) = [s for s in SCRIPTS if s.name == name]
    helped = run([script, "--help"])
    distributed = "--world-size" in helped.stdout
    bad = run([script, "--world-size", "0"] if distributed else [script, "--seed", "not-a-number"])
    check_help_and_bad_flag(script, {"code": helped.returncode, "stdout": helped.stdout, "stderr": helped.stderr},
                            {"code": bad.returncode, "stdout": bad.stdout, "stderr": bad.stderr})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_smoke_run(script, record_property, smoke_cache) -> None:
    """--smoke --json [--plot-dir]: exit 0, non-empty results, a figure where the script draws. The run is shared
    (conftest.smoke_run) with any oracle test that reads the smoke run's JSON."""
    proc = smoke_run(smoke_cache, script, record_property=record_property)
    assert proc["code"] == 0, f"exit {proc['code']}\nstdout:\n{proc['stdout']}\nstderr:\n{proc['stderr']}"
    doc = proc["json"]
    assert doc["results"], "the JSON results are empty"
    assert doc["settings"]["smoke"] is True
    if proc["plot_dir"] is not None:
        assert list(Path(proc["plot_dir"]).glob("*.png")), "a plotting script wrote no figure in --plot-dir"
