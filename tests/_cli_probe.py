"""Run many chapter scripts' command lines in ONE interpreter, as `python script.py ARGS` would run them, and print
what each did as JSON: exit code, stdout, stderr. Used by test_scripts_contract.py for --help and bad flags, which
exit while parsing, before any work: one interpreter that imports torch once instead of two per script.

    python tests/_cli_probe.py SCRIPT [SCRIPT ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


def run_like_python(script: Path, args: list[str]) -> dict:
    """`python script args`: the script as __main__, its folder first on sys.path, argv as given."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv, sys.path[0:0] = [str(script), *args], [str(script.parent)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
            except BaseException:  # what the interpreter would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    results = {}
    for name in sys.argv[1:]:
        script = Path(name).resolve()
        helped = run_like_python(script, ["--help"])
        distributed = "--world-size" in helped["stdout"]
        bad = run_like_python(script, ["--world-size", "0"] if distributed else ["--seed", "not-a-number"])
        results[name] = {"help": helped, "bad": bad, "distributed": distributed}
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
