"""Run tests against one mutmut mutant: does a test written to kill it fail on it?

    python scripts/mutant_check.py mlsys.rl.x_masked_mean__mutmut_3 tests/units/test_rl.py -k masked

It uses the mutants/ folder of the last `make mutate` the way mutmut does: mutants/mlsys (every listed function
behind a trampoline) goes first on PYTHONPATH and MUTANT_UNDER_TEST names the mutant, so the tests run against it,
from their place in the real tree (new tests included). Run it after a fresh `make mutate`: mutants/ holds the
library as it was then. The real tree is never changed. Exit status: pytest's (1 = the tests failed, i.e. the
mutant is killed; 0 = it survives), or 2 if there is no such mutant.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2
    name, tests = sys.argv[1], sys.argv[2:]
    module = name.split(".x_")[0] if ".x_" in name else name.rsplit(".", 1)[0]
    source = ROOT / "mutants" / (module.replace(".", "/") + ".py")
    mangled = name.rsplit(".", 1)[-1]
    if not source.is_file() or mangled not in source.read_text(encoding="utf-8"):
        print(f"mutant_check: no mutant {name} in {source.relative_to(ROOT)} (run make mutate first)",
              file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=str(ROOT / "mutants"), MUTANT_UNDER_TEST=name,
               MLSYS_CACHE=os.environ.get("MLSYS_CACHE") or str(ROOT / ".cache"))
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=ROOT, capture_output=True, text=True)
    print(shown.stdout, flush=True)
    # from mutants/, so that `python -m` puts mutants/ (not the real tree) first on sys.path; test paths made absolute
    tests = [str(ROOT / t) if (ROOT / t.split("::")[0]).exists() else t for t in tests]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), *tests], cwd=ROOT / "mutants", env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
