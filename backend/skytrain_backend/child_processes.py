"""Child processes that never outlive their parent: the one way skytrain starts them.

Every process skytrain starts (a local worker, a worker's engine, the demo's control plane,
a test's control plane) is a ``ChildProcess``:

- it runs in a process group of its own, so stopping it stops whatever it started too
  (and what left the group: torchrun starts each rank in a session of its own, so the
  processes it started when asked to stop are killed by pid at the end);
- on Linux it gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), however the parent
  ends; each generation sets the same for its own children, so a killed control plane takes
  its workers and their engines with it. (The signal follows the *thread* that started the
  child: start children from threads that live as long as the parent, such as the main
  thread or a pool thread, never from a short-lived one.)
- ``stop()`` sends SIGTERM to the group, waits ``grace_s``, then SIGKILLs what is left.

A process is named by ``ProcessIdentity``, its pid and start time, so a pid the system has
given to another process since is never signalled by mistake (the control plane records the
identities of the workers it starts, ``db.process_records``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import psutil

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
# Start times are read from /proc in clock ticks: two readings of one process agree closely.
_START_TIME_TOLERANCE_S = 0.05
# Loaded in the parent, so the forked child only calls into it (no loading after fork).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it can be told from any later process that reuses its pid."""

    pid: int
    start_time: float

    @classmethod
    def current(cls) -> ProcessIdentity:
        identity = cls.of(os.getpid())
        assert identity is not None
        return identity

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of the running process ``pid`` (None when there is none)."""
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None

    def is_running(self) -> bool:
        """Whether this very process still runs (not another one with its pid)."""
        now = ProcessIdentity.of(self.pid)
        if now is None or abs(now.start_time - self.start_time) > _START_TIME_TOLERANCE_S:
            return False
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        return False


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the parent dies (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent() -> None:
    """For a process another program started (torchrun's ranks, each in a session of its
    own): get SIGKILL when the parent dies, as a ``ChildProcess`` does; exit at once if it
    has already died (the process was handed to init or a subreaper meanwhile)."""
    parent = os.getppid()
    _die_with_parent()
    # Handed on already: to another process than the one read just before, or to init
    # (which starts no such process itself) when the parent died before that read.
    if os.getppid() != parent or parent == 1:
        os._exit(1)


class ChildProcess:
    """A started child process; see the module docstring."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.identity = ProcessIdentity.of(popen.pid) or ProcessIdentity(popen.pid, 0.0)

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: IO[bytes] | int | None = None,
        cwd: str | None = None,
    ) -> ChildProcess:
        """Start ``argv`` with exactly ``env``; output to ``stdout`` (stderr goes there too)."""
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if _LIBC is not None else None,
        )
        return cls(popen)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        return self.popen.wait(timeout=timeout_s)

    def send_signal(self, signum: int) -> None:
        """Signal the child alone (not its group), if it still runs."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``; reaps the child.

        The group is signalled even when the child itself has exited: what it started may
        not have.
        """
        family = _descendants(self.pid)
        _signal_group(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace_s)
        self.kill(family)

    def kill(self, family: Sequence[psutil.Process] | None = None) -> None:
        """SIGKILL the group and every process the child started (``family``: as found now),
        at once; reaps the child."""
        family = _descendants(self.pid) if family is None else family
        _signal_group(self.pid, signal.SIGKILL)
        for process in family:
            # psutil checks the pid still names the process it found: no stranger is killed.
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                process.kill()
        self.popen.wait()


def stop_process(identity: ProcessIdentity, grace_s: float = 15.0) -> bool:
    """Stop a process that is not this one's child (one a dead control plane started), and its
    group, as ``ChildProcess.stop`` does; False if it no longer ran."""
    if not identity.is_running():
        return False
    _signal_group(identity.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while identity.is_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    if identity.is_running():
        _signal_group(identity.pid, signal.SIGKILL)
    return True


def _descendants(pid: int) -> list[psutil.Process]:
    """The processes ``pid`` started, and theirs, whichever group or session they are in."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
