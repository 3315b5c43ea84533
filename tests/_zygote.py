"""A preloaded interpreter that runs each chapter script in a FRESH child forked from it, as `python script.py ARGS`
would: the smoke runs then skip importing torch, numpy and matplotlib every time (about 2 s per script on 2 cores;
the same idea as the launcher's fork server). Nothing else is shared: every run is its own process, with its own
stdout and stderr files, its own process group (so a timeout can kill all it started), and its exit code.

Protocol, one JSON object per line on stdin and stdout (tests/conftest.py: run_preloaded):
    -> {"argv": [script, arg...], "cwd": DIR, "env": {...}, "stdout": PATH, "stderr": PATH}
    <- {"pid": PID}            as soon as the child exists
    <- {"code": EXIT_CODE}     when it has ended (negative: killed by that signal, as subprocess reports)
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

import matplotlib

matplotlib.use("Agg")  # what a script without a display gets anyway
import matplotlib.pyplot
import numpy  # noqa: F401
import torch
import torch.distributed  # noqa: F401

import mlsys.cli
import mlsys.launch
import mlsys.plot
import mlsys.report  # noqa: F401


def child(request: dict) -> None:
    """In the forked child: become `python script args`, run it, exit with its code. Never returns."""
    os.setpgid(0, 0)
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # stdin was the zygote's request pipe
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        sys.argv, sys.path[0] = list(request["argv"]), os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except BaseException:  # what the interpreter prints before exiting 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # the interpreter's own shutdown hooks (multiprocessing's among them)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
