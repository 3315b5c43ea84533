"""The script contract, in one place.

Every script in the book declares its settings as a dataclass whose fields carry a docstring each; `parse` turns
that dataclass into a command line, so the docstrings become `--help`:

    @dataclass
    class Settings(cli.DistArgs):
        numel: int = 4
        '''Elements in each rank's tensor.'''

    args = cli.parse(Settings, __doc__, smoke={"numel": 2})

The base classes give every script `--seed`, `--smoke` and `--json PATH`; distributed scripts add
`--world-size/-w`, `--backend`, `--timeout`, `--all-ranks` and `--verbose`; scripts that draw add `--plot-dir`.

Exit codes are part of the contract, and `run(main)` enforces them: 0 success, 1 when the script's own self-check
fails (`SelfCheckFailed`) or a rank crashes, 2 on bad usage (`UsageError`, or an argparse error), always with a
one-line message and never a traceback for usage errors.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class UsageError(Exception):
    """A bad flag value. Reported as one line; exit code 2."""


class SelfCheckFailed(Exception):
    """The script computed something that disagrees with its reference. Exit code 1."""


class JobFailed(Exception):
    """A rank failed; `str()` is the report the user sees, `exit_code` what the process should exit with."""

    def __init__(self, rank: int, report: str, exit_code: int = 1):
        super().__init__(report)
        self.rank, self.exit_code = rank, exit_code


@dataclass
class Args:
    """Flags every script has."""

    seed: int = 0
    """Random seed; the same seed gives the same output."""
    smoke: bool = False
    """Tiny sizes, so the run takes a few seconds (this is what the tests run)."""
    json: str = ""
    """Write the key results to this JSON file."""


@dataclass
class DistArgs(Args):
    """Flags every multi-rank script has."""

    world_size: int = 2
    """Number of ranks to start. Under torchrun it is taken from WORLD_SIZE."""
    backend: typing.Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl with one GPU per rank when there are enough GPUs, else gloo on CPU."""
    timeout: float = 120.0
    """Seconds before a stuck rendezvous or collective fails instead of hanging."""
    all_ranks: bool = False
    """Print from every rank, not only rank 0."""
    verbose: bool = False
    """Trace every send, recv and collective call on every rank."""


@dataclass
class PlotArgs:
    """Flag for scripts that draw figures."""

    plot_dir: str = ""
    """Directory for the figures (default: .cache/figures/<script name>)."""


def resolve_backend(backend: str, world_size: int) -> str:
    """auto -> nccl when every local rank can have its own GPU, else gloo. Raises UsageError for impossible asks."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if backend == "auto":
        return "nccl" if gpus >= ranks_here and gpus > 0 else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise UsageError("--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo or auto")
        if gpus < ranks_here:
            raise UsageError(f"--backend nccl needs one GPU per rank: {ranks_here} ranks here, {gpus} GPU(s)")
    elif backend != "gloo":
        raise UsageError(f"unknown backend {backend!r}; choose auto, gloo or nccl")
    return backend


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source of `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                is_text = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                if is_text and isinstance(nxt.value.value, str):
                    docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _add_field(parser: argparse.ArgumentParser, field: dataclasses.Field, hint: typing.Any, doc: str) -> None:
    flags = ["--" + field.name.replace("_", "-")]
    if field.name == "world_size":
        flags.insert(0, "-w")
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
    help_text = f"{doc} (default: {default!r})" if doc else f"(default: {default!r})"
    if hint is bool:
        action = argparse.BooleanOptionalAction if default else "store_true"
        parser.add_argument(*flags, dest=field.name, action=action, help=doc or None)
    elif typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        parser.add_argument(*flags, dest=field.name, type=type(choices[0]), choices=choices, help=help_text)
    elif typing.get_origin(hint) in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        parser.add_argument(*flags, dest=field.name, type=item, nargs="+", metavar="N", help=help_text)
    else:
        parser.add_argument(*flags, dest=field.name, type=hint, metavar=field.name.upper(), help=help_text)


def build_parser(cls: type, doc: str | None) -> argparse.ArgumentParser:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else None
    parser = _Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                     argument_default=argparse.SUPPRESS)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        _add_field(parser, field, hints[field.name], docs.get(field.name, ""))
    return parser


def parse(cls: type, doc: str | None = None, *, argv: list[str] | None = None, smoke: dict | None = None,
          world_sizes: Callable[[int], bool] | Iterable[int] | None = None, world_sizes_text: str = "") -> typing.Any:
    """Parse the command line into an instance of `cls` and check it.

    Precedence: the dataclass defaults, then the `smoke` overrides when `--smoke` is given, then the flags the user
    typed. `world_sizes` says which world sizes the script supports (a predicate or a collection);
    `world_sizes_text` is how the error message describes them. Bad values raise SystemExit(2) with one line.
    """
    parser = build_parser(cls, doc)
    given = vars(parser.parse_args(argv))
    values = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    if given.get("smoke"):
        values.update(smoke or {})
    values.update(given)
    try:
        args = cls(**values)
        _check(args, given, world_sizes, world_sizes_text)
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return args


def _check(args: typing.Any, given: dict, world_sizes, world_sizes_text: str) -> None:
    if not 0 <= args.seed < 2**32:  # what numpy and gymnasium accept; torch would take any 64-bit value
        raise UsageError(f"--seed must be in 0..2**32-1, got {args.seed}")
    if isinstance(args, DistArgs):
        if under_torchrun():
            env_ws = int(os.environ["WORLD_SIZE"])
            if "world_size" in given and given["world_size"] != env_ws:
                raise UsageError(f"--world-size {given['world_size']} disagrees with torchrun's WORLD_SIZE={env_ws}")
            args.world_size = env_ws
        if args.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
        if world_sizes is not None:
            ok = world_sizes(args.world_size) if callable(world_sizes) else args.world_size in set(world_sizes)
            if not ok:
                raise UsageError(f"this script supports world sizes {world_sizes_text or world_sizes}, "
                                 f"got {args.world_size}")
        if args.timeout <= 0:
            raise UsageError(f"--timeout must be positive, got {args.timeout}")
        args.backend = resolve_backend(args.backend, args.world_size)
    validate = getattr(args, "validate", None)
    if callable(validate):
        validate()


def run(main: Callable[[], int | None]) -> typing.NoReturn:
    """Run a script's `main` and turn the outcome into the contract's exit code."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "script"
    try:
        code = main() or 0
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        code = 2
    except SelfCheckFailed as err:
        print(f"SELF-CHECK FAILED: {err}", file=sys.stderr)
        code = 1
    except JobFailed as err:
        print(str(err), file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.exit(code)
