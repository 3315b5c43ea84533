"""Apply one mutmut mutant to a scratch copy of the repository and run the given tests there.

A test written to kill a surviving mutant should fail here and pass on the real tree:

    python scripts/mutant_check.py mlsys.rl.x_masked_mean__mutmut_3 tests/test_ch12_rl.py -k masked

It needs a previous `make mutate` (the mutants/ folder, to read the mutant's diff with `mutmut show`). The real
tree is never touched: the copy lives in a temporary folder, first on PYTHONPATH. Exit status: pytest's (1 = the
tests failed, i.e. the mutant is killed), or 2 if the mutant could not be applied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2
    name, tests = sys.argv[1], sys.argv[2:]
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=ROOT, capture_output=True, text=True)
    diff = shown.stdout[shown.stdout.find("--- "):]
    if shown.returncode != 0 or not diff.startswith("--- "):
        print(f"mutant_check: no diff for {name}: {shown.stdout.strip()[:200]} {shown.stderr.strip()[-300:]}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mutant_") as tmp:
        for part in ("mlsys", "tests", "tutorial", "scripts", "pyproject.toml"):
            src = ROOT / part
            (shutil.copytree if src.is_dir() else shutil.copy)(src, Path(tmp) / part)
        applied = subprocess.run(["patch", "-p0", "--no-backup-if-mismatch"], input=diff, cwd=tmp, text=True,
                                 capture_output=True)
        if applied.returncode != 0:
            print(f"mutant_check: the diff does not apply:\n{applied.stdout}{applied.stderr}", file=sys.stderr)
            return 2
        env = dict(os.environ, PYTHONPATH=tmp, MLSYS_CACHE=os.environ.get("MLSYS_CACHE") or str(ROOT / ".cache"))
        print(f"mutant {name} applied in {tmp}:\n{diff}", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                               *tests], cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
