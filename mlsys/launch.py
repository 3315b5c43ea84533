"""One launcher for every multi-rank script: `launch(worker, args)`.

The same script runs three ways and the worker cannot tell the difference:

    python script.py -w 4                       # launch() spawns 4 processes itself
    torchrun --nproc-per-node 4 script.py       # torchrun started them: launch() runs the worker in this process
    torchrun --nnodes 2 --node-rank R ...       # multi-node: same, the env:// variables say where rank 0 is

Lifecycle of one rank (`_run_rank`): pick device and threads -> init_process_group(env://, timeout) -> worker(ctx, ...)
-> destroy_process_group, the last step in a `finally`, so it runs even when the worker raises. A spawned rank
(`_child_main`) first moves into an operating-system process group of its own (setpgid: not torch's process
group) and arms its lifeline (`_die_with_parent`), and only then unpickles the worker, which imports its module,
and its arguments, whose unpickling can run anything (`_Deferred`); before it, multiprocessing has only re-imported
the script itself, whose top level a script keeps to definitions (the `if __name__ == "__main__"` guard). A
rank's last flush of stdout and stderr cannot fail it: a worker that closed them and returned has succeeded.

Spawning (`_spawn`): the parent hosts the rendezvous store itself on port 0, so the operating system picks a free port
and two jobs started at the same moment can never collide (this is what torchrun's agent does too: every rank then
connects to the store as a client). If MASTER_ADDR/MASTER_PORT are set, they are honoured instead and rank 0 hosts
the store; the parent first checks that nothing already listens on that port, so a busy MASTER_PORT is a one-line
error (exit 1) before any rank starts, not a traceback from rank 0.

Watching (`_watch`): every rank sends the parent one message on its pipe, its result or its error report, stamped
with the time it was sent; a rank that ends without one (os._exit(n), a signal such as SIGKILL, a segfault) is seen
by its pipe's EOF and its exit code. The job stops when:

- a rank fails. The parent listens FAILURE_WINDOW_S longer, because the peers of a failed rank fail too ("connection
  closed by peer"), then names the rank that failed first (`_blame`): the earliest report, except that a rank that
  died without a report is blamed ahead of every report not sent clearly before (DEATH_SLACK_S) the parent last saw
  it alive, since its peers' errors are the consequence of its death and often reach the parent first. The
  message gives the rank's traceback, or its exit code or signal ("killed by SIGSEGV"; a segfault also prints the
  rank's Python stack, from faulthandler), and which ranks failed after it, each with its own failure in one line
  (its own self-check, a timeout, the last line of its error).
- a rank straggles: once any rank has returned from the worker, the others have --timeout seconds to do the same;
  a rank still running then ends the job with a one-line reason naming it.
- a rank makes no collective progress: the process group's timeout is --timeout, so ranks waiting in a collective
  for a rank that never joins it fail after --timeout ("Timed out waiting ..." on gloo), and ranks waiting in
  init_process_group for a rank that never gets there fail after --timeout too ("wait timeout" from the store;
  `TIMEOUT_TEXTS` lists what torch says). When every failure is such a timeout, the ranks still running without a
  report are the ones the others waited for, and they are named.

In every case the other ranks are terminated within a few seconds (they may be blocked inside a collective waiting
for the dead rank) and the parent raises `JobFailed`, which `cli.run` turns into a non-zero exit.

Nothing is left behind (`_terminate`): when the job ends, failed or not, the parent signals each rank's process
group, so the processes a rank started (and did not move to a session of their own) end with it: SIGTERM, then
SIGKILL for what is left after TERMINATE_GRACE_S. Being in groups of their own, the ranks no longer receive a
terminal's Ctrl-C themselves; the parent, which does, passes the SIGINT on to each rank's group and gives them
TERMINATE_GRACE_S to end on it (as torchrun forwards the signal it got and waits) before it stops what is left.
Ranks ask the kernel to kill them if their parent dies, and a lifeline thread kills the rank's group when the
launcher's end of its pipe closes, so no rank outlives its launcher, even one SIGKILLed. (What a rank started
goes with it then only if the thread gets there first: it does under the fork server, the default; with
MLSYS_START_METHOD=spawn the launcher is the rank's parent and the kernel's signal, which kills the rank alone,
usually wins.)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import errno
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from mlsys.cli import DistArgs, JobFailed, SelfCheckFailed, UsageError, resolve_backend, under_torchrun

__all__ = ["JobFailed", "RankContext", "WorkerGroup", "launch", "resolve_backend", "start_context", "start_workers",
           "threads_per_rank"]

TERMINATE_GRACE_S = 3.0  # SIGTERM, then this long before SIGKILL
FAILURE_WINDOW_S = 1.0  # after a failed exit, how long to wait for the other ranks' reports
POLL_S = 0.5  # the parent's longest sleep while it watches the ranks
DEATH_SLACK_S = 0.5  # a report must precede a silent death by this much to be blamed ahead of it (see _blame)


@dataclass
class RankContext:
    """What a worker knows about its place in the job. Passed explicitly as the worker's first argument."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: Any  # torch.device: cuda:<local_rank> with nccl, cpu with gloo
    all_ranks: bool = False
    verbose: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *objects: Any, all_ranks: bool | None = None, sep: str = " ") -> None:
        """Print from rank 0 only (or from every rank with a `[rank r]` prefix), one atomic write per call."""
        every = self.all_ranks if all_ranks is None else all_ranks
        if not every and self.rank != 0:
            return
        text = sep.join(str(o) for o in objects)
        if every and self.world_size > 1:
            text = "\n".join(f"[rank {self.rank}] {line}" for line in text.splitlines() or [""])
        sys.stdout.write(text + "\n")  # one write of whole lines: lines from different ranks never mix
        sys.stdout.flush()

    def print_ordered(self, text: str) -> None:
        """Collective: every rank passes a text, rank 0 prints them all in rank order. All ranks must call it."""
        from torch.distributed import distributed_c10d  # the untraced function: --verbose shows the script's calls

        texts: list[Any] = [None] * self.world_size
        distributed_c10d.all_gather_object(texts, text)
        if self.rank == 0:
            lines = [f"[rank {r}] {line}" for r, t in enumerate(texts) for line in str(t).splitlines()]
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()


# ----------------------------------------------------------------------------------------------- choosing a backend
def threads_per_rank(local_world_size: int) -> int:
    """Split this machine's cores between the ranks on it: 2 ranks on 2 cores get 1 thread each, not 2 and 2.
    An OMP_NUM_THREADS you set wins (a positive integer), as it does for torch itself and under torchrun."""
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


# ----------------------------------------------------------------------------------------------- the public entry
@dataclass
class LaunchOptions:
    world_size: int = 2
    backend: str = "auto"
    timeout: float = 120.0
    all_ranks: bool = False
    verbose: bool = False


def launch(worker: Callable[..., Any], *worker_args: Any, **overrides: Any) -> Any:
    """Run `worker(ctx, *worker_args)` on every rank; return rank 0's return value where the job is owned.

    Options (world_size, backend, timeout, all_ranks, verbose) come from the first worker argument when it is a
    `cli.DistArgs`, and keyword arguments override them. The return value is rank 0's result in the process that
    owns the job (the parent when spawning, rank 0 under torchrun) and None on the other torchrun ranks.
    """
    opts = LaunchOptions()
    if worker_args and isinstance(worker_args[0], DistArgs):
        source = worker_args[0]
        opts = LaunchOptions(**{f.name: getattr(source, f.name) for f in dataclasses.fields(LaunchOptions)})
    opts = dataclasses.replace(opts, **overrides)
    if under_torchrun():
        _import_before_the_group()
        opts.world_size = int(os.environ["WORLD_SIZE"])
        opts.backend = resolve_backend(opts.backend, opts.world_size)
        result = _run_rank(worker, worker_args, opts)
        return result if int(os.environ["RANK"]) == 0 else None
    if opts.world_size < 1:
        raise UsageError(f"world size must be at least 1, got {opts.world_size}")
    opts.backend = resolve_backend(opts.backend, opts.world_size)
    return _spawn(worker, worker_args, opts)


def _import_before_the_group() -> None:
    """Under torchrun a rank ends by tearing its interpreter down (a spawned rank skips that: `os._exit`), so
    nothing may keep the process group alive past destroy_process_group. torch.distributed.fsdp's
    sharded_grad_scaler gives ShardedGradScaler the default argument `process_group=dist.group.WORLD`, evaluated
    when the module is first imported; DistributedDataParallel's constructor imports it (through torch._dynamo).
    Imported after init_process_group, that default holds the default group for the life of the process: gloo's
    threads outlive destroy_process_group, and the rank can abort in teardown ("terminate called without an
    active exception", after the job's output). Imported before, the default is None."""
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401


# ----------------------------------------------------------------------------------------------- one rank
def _run_rank(worker: Callable[..., Any], worker_args: tuple, opts: LaunchOptions) -> Any:
    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(threads_per_rank(local_world_size))
    if opts.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        opts.backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=opts.timeout), device_id=device if opts.backend == "nccl" else None,
    )
    try:
        if opts.verbose:
            from mlsys import trace

            trace.enable(rank)
        ctx = RankContext(rank, world_size, local_rank, local_world_size, opts.backend, device,
                          opts.all_ranks, opts.verbose)
        return worker(ctx, *worker_args)
    finally:
        dist.destroy_process_group()


def _die_with_parent(conn: mp.connection.Connection, direct_parent: int | None) -> None:
    """Make sure this rank, and what it started, cannot outlive the launcher that started it.

    Called first thing in the rank, before anything of the job runs (see `_Deferred`). The rank's pipe to the
    launcher is a socket pair: a daemon thread waits on it, and when the launcher dies the read ends (EOF) and the
    rank kills its process group, itself included. This works whatever forked us (with forkserver, our parent
    process is the fork server, not the launcher). On Linux, PR_SET_PDEATHSIG covers the direct parent as well (it
    kills the rank alone: its children are left to the thread, whichever comes first). A parent that died before
    prctl never sends the signal, so once armed we check that it is still there (`direct_parent`, when we know its
    pid) and that the launcher has not closed its end of the pipe already.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except OSError:
            pass

    def die() -> None:
        if os.getpgrp() == os.getpid():  # our own group (`_child_main`): take our children with us
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    if direct_parent is not None and os.getppid() != direct_parent:
        die()  # reparented: the parent died before prctl
    try:
        if conn.poll(0):  # the launcher never writes to us: readable means EOF, it is gone
            die()
    except OSError:
        die()

    def watch() -> None:
        try:
            while conn.poll(None):  # the launcher never writes to us, so poll only returns at EOF
                conn.recv()
        except (EOFError, OSError):
            pass
        die()

    threading.Thread(target=watch, name="launcher-lifeline", daemon=True).start()


# What a timeout says in torch 2.x: gloo's collectives "Timed out waiting ...", the rendezvous store's client "wait
# timeout after N ms, keys: ..." (TCPStore; FileStore and HashStore: "Timeout waiting for key", "Wait timeout"),
# its socket "Socket Timeout", "Read timeout", "Connect timeout", "... timed out after ...", the store barrier
# "barrier timeout after N ms" and init's "Timed out initializing process group in store based barrier".
TIMEOUT_TEXTS = ("timed out", "wait timeout", "timeout waiting for key", "socket timeout", "read timeout",
                 "write timeout", "connect timeout", "barrier timeout")


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, TimeoutError) or any(t in text for t in TIMEOUT_TEXTS)


def _report(rank: int, err: BaseException, joined: bool = True) -> tuple[str, str, float]:
    """(kind, text, when) for the parent; `when` lets it tell the rank that failed first from its victims. A
    timeout is "timeout", or "join-timeout" when the rank had not joined the process group yet (`joined`)."""
    if isinstance(err, SelfCheckFailed):
        return "selfcheck", f"self-check failed on rank {rank}: {err}", time.time()
    if isinstance(err, UsageError):
        return "usage", f"rank {rank}: error: {err}", time.time()
    kind = ("timeout" if joined else "join-timeout") if _is_timeout(err) else "error"
    return kind, f"rank {rank} failed:\n{traceback.format_exc()}", time.time()


class _Deferred:
    """An object that travels with a rank's Process as pickled bytes and is unpickled only when the rank calls
    `load()`. multiprocessing unpickles a Process's arguments before its target runs, and unpickling the worker
    imports its module and unpickling its arguments can run any code (a `__reduce__`, a `__setstate__`): the rank
    must have made its process group and armed its lifeline before that. The bytes are made while the Process is
    pickled, so what needs the start method's help (a tensor's shared memory, a file descriptor) gets it."""

    def __init__(self, obj: Any = None, data: bytes | None = None) -> None:
        self.obj, self.data = obj, data

    def __reduce__(self) -> tuple:
        return _Deferred, (None, bytes(ForkingPickler.dumps(self.obj)))

    def load(self) -> Any:
        return self.obj if self.data is None else ForkingPickler.loads(self.data)


def _child_main(rank: int, job: _Deferred, opts: LaunchOptions, env: dict[str, str],
                conn: mp.connection.Connection, direct_parent: int | None) -> None:
    # first, before anything of the job is unpickled: a process group of our own, so that the launcher can stop us
    # and all we start with one signal (os.killpg); and the lifeline. A terminal's Ctrl-C no longer reaches us
    # directly (we are not in its foreground group): the launcher passes it on (`_spawn`).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent(conn, direct_parent)
    faulthandler.enable(all_threads=False)  # a segfault prints where this rank was, then kills it
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    sent = joined = False

    def reporting_worker(ctx: RankContext, *args: Any) -> Any:
        nonlocal sent, joined
        joined = True
        try:
            return worker(ctx, *args)
        except BaseException as err:  # report before teardown, while the peers are still connected
            conn.send(_report(rank, err))
            sent = True
            raise

    code = 0
    try:
        worker, worker_args = job.load()
        result = _run_rank(reporting_worker, worker_args, opts)
        conn.send(("ok", result if rank == 0 else None, time.time()))
    except BaseException as err:
        if not sent:
            conn.send(_report(rank, err, joined))
        code = 2 if isinstance(err, UsageError) else 1
    finally:
        conn.close()
        for stream in (sys.stdout, sys.stderr):  # the worker may have closed them: not a failure of the rank
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)  # skip interpreter teardown: a rank whose peer died must not linger in atexit hooks


def _rank_process(context: Any, rank: int, worker: Callable[..., Any], worker_args: tuple, opts: LaunchOptions,
                  env: dict[str, str], conn: mp.connection.Connection, **kwargs: Any) -> Any:
    """The Process for one rank, running `_child_main`. Its direct parent is this process, except under the fork
    server (the default): that parent's pid is not known here, and the rank watches the launcher through `conn`."""
    direct_parent = None if context.get_start_method() == "forkserver" else os.getpid()
    return context.Process(target=_child_main, name=f"rank{rank}",
                           args=(rank, _Deferred((worker, worker_args)), opts, env, conn, direct_parent), **kwargs)


# ----------------------------------------------------------------------------------------------- the parent
# --8<-- [start:rendezvous]
def _rendezvous(world_size: int, timeout: float) -> tuple[dict[str, str], Any]:
    """Environment for the children, and the store the parent hosts (None when the user chose MASTER_PORT)."""
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
    if "MASTER_PORT" in os.environ:  # the user's choice wins; rank 0 then hosts the store
        env["MASTER_PORT"] = str(_free_master_port(os.environ["MASTER_PORT"]))
        return env, None
    import torch.distributed as dist

    # port=0: the kernel hands out a free port atomically, with no window for another job to take it. On a
    # loopback MASTER_ADDR (the default) the store listens there only: TCPStore alone would listen on every
    # interface, and anyone who reaches the port could write into the job's rendezvous.
    listen = _loopback_socket(env["MASTER_ADDR"])
    store = dist.TCPStore(env["MASTER_ADDR"], listen.getsockname()[1] if listen else 0, world_size, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout),
                          **({"master_listen_fd": listen.detach()} if listen else {}))
    env.update(MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")  # every rank joins as a client
    return env, store
# --8<-- [end:rendezvous]


def _loopback_socket(addr: str):
    """A socket listening on a free port of `addr` when it is a loopback address (127.x, ::1, localhost), for the
    store to adopt; None otherwise (a store for other hosts must listen where they can reach it)."""
    import ipaddress
    import socket

    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1" if addr == "localhost" else addr, 0))
    sock.listen(128)
    return sock


def _free_master_port(text: str) -> int:
    """The user's MASTER_PORT, checked before any rank starts: a busy port is a one-line error, not a traceback.

    Rank 0 will listen on it on every interface, as the store does (with SO_REUSEADDR, so a port that a finished job
    left in TIME_WAIT counts as free). Something could still take the port between this check and rank 0's bind;
    that rare race ends as an ordinary failure of rank 0.
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise UsageError(f"MASTER_PORT must be a port number from 1 to 65535, got {text!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "launcher"
            why = "is already in use" if err.errno == errno.EADDRINUSE else f"cannot be used ({err.strerror})"
            raise JobFailed(0, f"{prog}: error: MASTER_PORT={port} {why} on this machine, so rank 0 cannot host "
                               "the rendezvous store there; choose another port, or unset MASTER_PORT and the "
                               "launcher picks a free one", 1) from None
    return port


def start_context() -> Any:
    """forkserver with torch preloaded: each rank forks from a clean process that has already imported torch.

    A fresh interpreter per rank ("spawn") would import torch once per rank, about 2 s each on a small CPU; forking
    our own process instead is unsafe once it has started threads (the store above runs one). The fork server is a
    single-threaded process that imports torch once, so its forks start in milliseconds. MLSYS_START_METHOD=spawn
    switches back to the plain method.
    """
    method = os.environ.get("MLSYS_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed"])
    return context


def _spawn(worker: Callable[..., Any], worker_args: tuple, opts: LaunchOptions) -> Any:
    env, store = _rendezvous(opts.world_size, opts.timeout)
    context = start_context()
    procs, conns = [], []
    try:
        for rank in range(opts.world_size):
            ours, theirs = context.Pipe(duplex=True)  # results come back on it; its EOF tells a rank we died
            proc = _rank_process(context, rank, worker, worker_args, opts, env, theirs)
            procs.append(proc)  # before start: a Ctrl-C inside start() must still find it in the finally
            conns.append(ours)
            with _interrupt_after():  # so that a started rank always has its pid, for _terminate to stop it
                proc.start()
            theirs.close()
        ranks, stragglers = _watch(procs, conns, opts.timeout)
    except KeyboardInterrupt:  # the ranks sit in process groups of their own, out of the terminal's reach
        _signal_ranks(procs, signal.SIGINT)  # so they, and what they started, get the Ctrl-C as from it
        _wait_for_groups(procs, TERMINATE_GRACE_S)  # and have time to act on it before _terminate's SIGTERM
        raise
    finally:
        _terminate(procs)
        for conn in conns:
            conn.close()
        del store
    for proc, seen in zip(procs, ranks):
        if seen.gone is not None:  # exited before the parent stopped the job: its own exit code, not our SIGTERM
            seen.exitcode = proc.exitcode
    if stragglers:
        raise _straggler_failure(stragglers, ranks, opts.timeout)
    stuck = _stuck(ranks)
    if stuck:
        raise _stuck_failure(stuck, ranks, opts.timeout)
    failed = _blame(ranks)
    if failed is not None:
        raise _failure(failed, ranks)
    message = ranks[0].message
    return message[1] if message is not None and message[0] == "ok" else None


# ------------------------------------------------------------------------------------- a driver and its workers
class WorkerGroup:
    """Ranks 1..N-1 started by `start_workers`, with this process as rank 0. The ranks run the launcher's own
    `_child_main` (same rank set-up, same lifeline: a worker kills itself if this process dies), so no worker can
    outlive the driver. Each is in a process group of its own: a terminal's Ctrl-C reaches the driver alone, which
    decides what happens to the workers (serve.py drains, then closes), and `close` stops what they started too."""

    def __init__(self, procs: list, conns: list, store: Any) -> None:
        self.procs, self.conns, self._store = procs, conns, store

    def dead(self) -> str | None:
        """None while every worker runs; else which one ended and how (e.g. "rank 2 exited (killed by SIGKILL)")."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                proc.join()
                report = ""
                conn = self.conns[rank - 1]
                with contextlib.suppress(EOFError, OSError):
                    if conn.poll(0):
                        kind, text, _ = conn.recv()
                        report = f": {text.strip().splitlines()[-1]}" if kind != "ok" else ""
                return f"rank {rank} exited ({_how(proc.exitcode)}){report}"
        return None

    def close(self, grace: float = 5.0) -> None:
        """Wait up to `grace` s for the workers to return (the driver has told them to), then stop the rest, and
        leave this process's process group."""
        import torch.distributed as dist

        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        _terminate(self.procs)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


def start_workers(worker: Callable[..., Any], world_size: int, *worker_args: Any, backend: str = "auto",
                  timeout: float = 120.0) -> WorkerGroup:
    """Make this process rank 0 of a new `world_size`-rank process group and start ranks 1..N-1 running
    `worker(ctx, *worker_args)`. For a driver that keeps working while its workers serve (tensor-parallel
    inference, mlsys/engine/tp.py); a job whose ranks all run one function and end uses `launch`. Returns once
    every rank has joined the group."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("start_workers: this process already belongs to a process group")
    opts = LaunchOptions(world_size=world_size, backend=resolve_backend(backend, world_size), timeout=timeout)
    env, store = _rendezvous(world_size, timeout)
    if store is None:  # MASTER_PORT chosen by the user: rank 0 hosts the store, and rank 0 is us
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    context = start_context()
    procs, conns = [], []
    try:
        for rank in range(1, world_size):
            ours, theirs = context.Pipe(duplex=True)
            proc = _rank_process(context, rank, worker, worker_args, opts, env, theirs, daemon=True)
            procs.append(proc)
            conns.append(ours)
            with _interrupt_after():
                proc.start()
            theirs.close()
        # the ranks join through env://, which keeps the group's keys under "default_pg" in the store: so must we
        dist.init_process_group(opts.backend, store=dist.PrefixStore("default_pg", store), rank=0,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        _terminate(procs)
        raise
    return WorkerGroup(procs, conns, store)


@contextlib.contextmanager
def _interrupt_after():
    """Hold a Ctrl-C back until the block ends, then raise it. Process.start() learns a forkserver child's pid
    only after the child exists; a KeyboardInterrupt in between left a running rank with no pid: _terminate
    could not stop it (an orphan, and the store's shutdown waited for its connection)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives Python's signal handlers
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending and callable(previous):
            previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
        elif pending and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


@dataclass
class _Seen:
    """What the parent saw of one rank. Times are time.time() (the ranks stamp their reports with it too)."""

    message: tuple | None = None  # (kind, payload, when sent): "ok", "error", "selfcheck" or "usage"
    gone: tuple[float, float] | None = None  # (last seen alive, first seen gone): when it exited, to within this
    exitcode: int | None = None  # filled in once the parent has seen it exit

    @property
    def reported_error(self) -> bool:
        return self.message is not None and self.message[0] != "ok"

    @property
    def died_silently(self) -> bool:
        """Exited with a failure and no error report: os._exit(n), a signal, a segfault, the kernel's OOM killer."""
        return self.gone is not None and not self.reported_error and self.exitcode not in (0, None)


def _watch(procs: list, conns: list, timeout: float) -> tuple[list[_Seen], list[int]]:
    """Wait until every rank has exited, one has failed, or one straggles. Returns (what we saw, the stragglers).

    Each rank's pipe carries one message (its result or its error report); its EOF, or the process sentinel, says it
    has exited. After the first sign of failure we keep listening for FAILURE_WINDOW_S, so the ranks that failed
    as a consequence are seen too, and `_blame` picks the first. After the first rank returns from the worker, the
    others have `timeout` seconds to do the same: a rank still running then is a straggler and the job stops.

    Every return of `wait` is a snapshot: a rank whose handles were not ready was still alive at that moment. So a
    rank first seen gone in this snapshot died between the previous snapshot and now: `_Seen.gone` keeps both ends.
    """
    seen = [_Seen() for _ in procs]
    waiting: dict[Any, tuple[str, int]] = {}
    for rank, (proc, conn) in enumerate(zip(procs, conns)):
        waiting[proc.sentinel] = ("exit", rank)
        waiting[conn] = ("msg", rank)
    window_end: float | None = None  # monotonic: stop listening then, after a failure
    returned_by: float | None = None  # monotonic: the first rank returned from the worker; stragglers after that
    snapshot = time.time()
    while any(kind == "exit" for kind, _ in waiting.values()):
        now_m = time.monotonic()
        if window_end is not None and now_m >= window_end:
            break  # the listening window after a failure is over
        if window_end is None and returned_by is not None and now_m >= returned_by + timeout:
            running = [r for r, s in enumerate(seen) if s.message is None and s.gone is None]
            return seen, running  # an empty list: every rank has its result in, some are slow to exit
        # wake at least every POLL_S: a Ctrl-C that the kernel hands to another thread of this process (the
        # store's) only sets a flag, and the main thread acts on it when it next runs Python code
        ends = [t for t in (window_end, None if returned_by is None else returned_by + timeout) if t is not None]
        ready = mp.connection.wait(list(waiting), min([POLL_S, *(t - now_m for t in ends)]))
        previous, snapshot = snapshot, time.time()
        for handle in ready:
            kind, rank = waiting.pop(handle)
            if kind == "msg":
                try:
                    seen[rank].message = handle.recv()
                except EOFError:  # exited without a word: the sentinel will give the exit code
                    seen[rank].gone = seen[rank].gone or (previous, snapshot)
                    window_end = window_end or time.monotonic() + FAILURE_WINDOW_S
                    continue
                if seen[rank].reported_error:
                    window_end = window_end or time.monotonic() + FAILURE_WINDOW_S
                elif returned_by is None:
                    returned_by = time.monotonic()
                continue
            procs[rank].join()
            seen[rank].gone = seen[rank].gone or (previous, snapshot)
            seen[rank].exitcode = procs[rank].exitcode
            if procs[rank].exitcode != 0:
                window_end = window_end or time.monotonic() + FAILURE_WINDOW_S
    return seen, []


def _blame(seen: list[_Seen]) -> int | None:
    """The rank that failed first, or None if none failed.

    Reports carry the time the rank sent them; a rank that died without one (os._exit, a signal, a segfault) has
    only the interval in which the parent saw it go. Its peers then fail *because* it is gone ("connection closed
    by peer") and report a moment later, often before the parent has even noticed the death: a dying process closes
    its files one by one and can be preempted in between, so its peers may see their sockets close before the
    parent sees its pipe close. So a silent death is blamed ahead of every report unless that report was sent
    clearly before the dead rank was last seen alive: by more than DEATH_SLACK_S.
    """
    reports = {r: s.message[2] for r, s in enumerate(seen) if s.reported_error}
    silent = {r: s.gone for r, s in enumerate(seen) if s.died_silently}
    first_report = min(reports, key=lambda r: reports[r]) if reports else None
    if silent:
        first_silent = min(silent, key=lambda r: (silent[r][1], silent[r][0], r))
        last_alive = silent[first_silent][0]
        if first_report is None or not reports[first_report] < last_alive - DEATH_SLACK_S:
            return first_silent
    return first_report


def _stuck(seen: list[_Seen]) -> list[int]:
    """Ranks that made no collective progress: every failure is a timeout, in a collective or in init_process_group
    (the store's "wait timeout"), and these ranks, with no report, were still running when the parent stopped
    listening. They never joined the collective, or the process group, the others waited in (a loop, a deadlock, a
    slow rank, a rank stuck in its set-up), so they, not the ranks that timed out, are to blame."""
    failed = [s for s in seen if s.reported_error or s.died_silently]
    if not failed or any(s.died_silently or s.message[0] not in ("timeout", "join-timeout")  # type: ignore[index]
                         for s in failed):
        return []
    return [r for r, s in enumerate(seen) if s.message is None and s.gone is None]


def _stuck_failure(stuck: list[int], seen: list[_Seen], timeout: float) -> JobFailed:
    waited = ", ".join(str(r) for r, s in enumerate(seen) if s.reported_error)
    ranks = ", ".join(map(str, stuck))
    if all(s.message[0] == "join-timeout" for s in seen if s.reported_error):  # type: ignore[index]
        return JobFailed(stuck[0], f"job stopped: rank(s) {ranks} never joined the process group: rank(s) {waited} "
                         f"timed out after {timeout:g} s (--timeout) waiting for them in init_process_group; they "
                         f"were terminated", 1)
    return JobFailed(stuck[0], f"job stopped: rank(s) {ranks} made no collective progress: rank(s) {waited} timed "
                     f"out after {timeout:g} s (--timeout) in a collective that rank(s) {ranks} never joined; "
                     f"they were terminated", 1)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _own_failure(rank: int, seen: _Seen) -> str:
    """One line on how `rank` itself failed, from its own report (not assumed to be a consequence of another's)."""
    if seen.died_silently:
        return f"rank {rank} died ({_how(seen.exitcode)})"
    kind, text, _ = seen.message  # type: ignore[misc]
    if kind == "selfcheck":
        return f"rank {rank} failed its own self-check"
    if kind == "usage":
        return f"rank {rank} hit a usage error"
    if kind in ("timeout", "join-timeout"):
        where = "a collective" if kind == "timeout" else "init_process_group"
        return f"rank {rank} timed out in {where}"
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "an error")
    last = re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ", "", last)  # gloo's "[.../pair.cc:553] " source location
    last = last.split(". ")[0]  # its first sentence: gloo goes on with advice
    return f"rank {rank} raised {last if len(last) <= 120 else last[:117] + '...'}"


def _failure(rank: int, seen: list[_Seen]) -> JobFailed:
    others = sorted(r for r, s in enumerate(seen) if r != rank and (s.reported_error or s.died_silently))
    if seen[rank].reported_error:
        kind, text, _ = seen[rank].message  # type: ignore[misc]
    else:
        kind, text = "died", f"rank {rank} died ({_how(seen[rank].exitcode)}) without a Python exception or report"
    if others:
        after = ", ".join(map(str, others))
        own = "; ".join(_own_failure(r, seen[r]) for r in others)
        note = (f"(job stopped: rank {rank} failed first; rank(s) {after} failed after it: {own}; any rank still "
                "running was terminated)")
    else:
        note = f"(job stopped: rank {rank} failed; the other ranks were terminated)"
    return JobFailed(rank, f"{text.rstrip()}\n{note}", 2 if kind == "usage" else 1)


def _straggler_failure(stragglers: list[int], seen: list[_Seen], timeout: float) -> JobFailed:
    returned = [r for r, s in enumerate(seen) if s.message is not None and s.message[0] == "ok"]
    first = min(returned, key=lambda r: seen[r].message[2])  # type: ignore[index]
    ranks = ", ".join(map(str, stragglers))
    return JobFailed(stragglers[0], f"job stopped: rank(s) {ranks} still running {timeout:g} s after rank {first} "
                     f"returned from the worker (--timeout {timeout:g}); they were terminated", 1)


def _signal_ranks(procs: list, signum: int) -> None:
    """Send `signum` to each started rank's process group (the rank and everything it started), and to the rank
    itself while it runs (in case it has not made its group yet)."""
    for proc in procs:
        if proc.pid is None:  # an interrupted start() may leave one unstarted
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)  # the group outlives its leader while any member is left
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signum)


def _group_alive(pgid: int) -> bool:
    """True while process group `pgid` has a member that has not exited (a zombie waiting for its reaper has)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc"):
        return True
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(group) == pgid and state != "Z":
                return True
    return False


def _wait_for_groups(procs: list, seconds: float) -> None:
    """Wait until every started rank and its process group have ended, or `seconds` have passed."""
    procs = [proc for proc in procs if proc.pid is not None]
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    while time.monotonic() < deadline and any(_group_alive(proc.pid) for proc in procs):
        time.sleep(0.05)


def _terminate(procs: list) -> None:
    """SIGTERM every rank's process group (each rank and whatever it started, exited rank or not), then SIGKILL
    whatever is still there after a short grace period."""
    procs = [proc for proc in procs if proc.pid is not None]  # an interrupted start() may leave one unstarted
    _signal_ranks(procs, signal.SIGTERM)
    _wait_for_groups(procs, TERMINATE_GRACE_S)
    left = [proc for proc in procs if proc.exitcode is None or _group_alive(proc.pid)]
    _signal_ranks(left, signal.SIGKILL)
    for proc in left:
        proc.join()
