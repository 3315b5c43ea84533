"""Workshop helpers around the exercise checker: progress over every exercise, and graded hints.

    make progress                 # every exercise: PASS / FAIL / TODO / NEEDS GPU (cached by content hash)
    make hint EX=ch05.2           # the next hint of that exercise (each call shows one more)
    python -m mlsys.workshop progress --solution     # the same table for the reference solutions
    python -m mlsys.workshop hint ch05.2 --reset     # start its hints again from the first
    make hint EX=ch13.1 FOR=shape_rewards         # the hints about one function (a FAIL names it)

Hints live beside the exercise: `exercises/hints/ex<K>.md`, hints separated by lines holding only `---`, from a
nudge to nearly the answer; a hint that starts with a line `for: name` is about that function of the attempt,
and the checker prints `hint: make hint EX=... FOR=name` under a FAIL of a task that checks it.
How many you have seen is kept in `.cache/workshop/hints.json`; progress results in
`.cache/workshop/progress.json`, keyed by a hash of the attempt, its checker and the checker machinery, so an
unchanged attempt is not run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from mlsys import exercises

STATE = exercises.REPO_ROOT / ".cache" / "workshop"


def _load(name: str) -> dict:
    try:
        return json.loads((STATE / name).read_text())
    except (OSError, ValueError):
        return {}


def _save(name: str, data: dict) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    tmp = STATE / (name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(STATE / name)


def summary(outcomes: list[exercises.Outcome]) -> str:
    """One word for an exercise: PASS when every task passes (GPU tasks aside), TODO when nothing is attempted,
    NEEDS GPU when only GPU tasks remain, else FAIL."""
    statuses = {o.status for o in outcomes}
    if statuses <= {"PASS", "NEEDS GPU"}:
        return "PASS" if "PASS" in statuses else "NEEDS GPU"
    if statuses <= {"TODO", "NEEDS GPU"}:
        return "TODO"
    return "FAIL"


def digest(exercise: exercises.Exercise, target: Path) -> str:
    """The cache key of one exercise's verdict: the attempt, its checker and every file of the mlsys package (the
    checking machinery and the library the checkers compare against, such as mlsys.rl's references), so that a
    changed reference never leaves a stale PASS behind."""
    h = hashlib.sha256()
    library = sorted(Path(exercises.__file__).parent.rglob("*.py"))
    for path in (target, exercise.checker, *library):
        h.update(str(path).encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(missing)"))
    return h.hexdigest()


def progress(solution: bool = False, time_limit: float = exercises.DEFAULT_TIME_LIMIT) -> list[dict]:
    cache, rows = _load("progress.json"), []
    for ex in exercises.all_exercises():
        target = ex.solution if solution else ex.attempt
        key = digest(ex, target)
        if key not in cache:
            outcomes = exercises.check(ex, solution, target, time_limit)
            cache[key] = {"status": summary(outcomes), "passed": sum(o.status == "PASS" for o in outcomes),
                          "tasks": len(outcomes)}
            _save("progress.json", cache)
        rows.append({"id": ex.exercise_id, **cache[key], "file": str(target.relative_to(exercises.REPO_ROOT))})
    return rows


def hints_of(exercise: exercises.Exercise, about: str | None = None) -> list[str]:
    """The hints to show, graded from a nudge to nearly the answer: all of them, or with `about` the ones for
    that function plus the untagged ones."""
    return [text for tags, text in exercises.tagged_hints(exercise) if about is None or not tags or about in tags]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlsys.workshop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("progress", help="every exercise's status")
    p.add_argument("--solution", action="store_true", help="the reference solutions instead of your attempts")
    h = sub.add_parser("hint", help="the next hint of one exercise")
    h.add_argument("exercise", help="an id such as ch05.2")
    h.add_argument("--reset", action="store_true", help="forget the hints shown so far")
    h.add_argument("--for", dest="about", metavar="FUNCTION",
                   help="only the hints about this function of the attempt (the checker names it under a FAIL)")
    args = parser.parse_args(argv)
    if args.command == "progress":
        rows = progress(args.solution)
        width = max(len(r["file"]) for r in rows)
        for r in rows:
            print(f"{r['id']:<7} {r['status']:<9} {r['passed']}/{r['tasks']} tasks  {r['file']:<{width}}")
        done = sum(r["status"] == "PASS" for r in rows)
        nxt = next((r["id"] for r in rows if r["status"] in ("TODO", "FAIL")), None)
        print(f"\n{done} of {len(rows)} exercises pass" + (f"; next: make check EX={nxt}" if nxt else ""))
        return 0
    try:
        ex = exercises.find(args.exercise)
    except LookupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seen = _load("hints.json")
    key = ex.exercise_id + (f":{args.about}" if args.about else "")
    if args.reset:
        for k in [k for k in seen if k == ex.exercise_id or k.startswith(ex.exercise_id + ":")]:
            seen.pop(k)
        _save("hints.json", seen)
        print(f"{ex.exercise_id}: hints reset")
        return 0
    hints = hints_of(ex, args.about)
    if args.about and not any(args.about in tags for tags, _ in exercises.tagged_hints(ex)):
        names = sorted({n for tags, _ in exercises.tagged_hints(ex) for n in tags})
        print(f"error: no hint of {ex.exercise_id} is about {args.about!r}"
              + (f"; hints are about: {', '.join(names)}" if names else "; its hints are not tagged"),
              file=sys.stderr)
        return 2
    if not hints:
        print(f"{ex.exercise_id} has no hints yet; its stub's docstring and the lesson section it names are the "
              f"place to look ({ex.attempt.relative_to(exercises.REPO_ROOT)})")
        return 0
    shown = min(seen.get(key, 0) + 1, len(hints))
    seen[key] = shown
    _save("hints.json", seen)
    what = f" about {args.about}" if args.about else ""
    print(f"{ex.exercise_id}, hint {shown} of {len(hints)}{what}:\n\n{hints[shown - 1]}")
    if shown == len(hints):
        print(f"\n(that was the last hint; the reference solution is {ex.solution.relative_to(exercises.REPO_ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
