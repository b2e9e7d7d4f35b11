"""``python -m tensordbg.cli ...`` and ``python script.py ...`` for the tests, without paying for
an interpreter that imports torch each time (2-6 s of the 2-core VM's CPU per run).

One helper interpreter per test process (each pytest-xdist worker), the *zygote*, imports torch
and tensordbg once and runs no torch operation (so no thread pool of torch's has started and a
fork is safe). Each run forks it: the child takes the run's working directory, environment,
``sys.argv`` and ``sys.path[0]``, writes to the caller's pipes for stdout and stderr, and runs
the module or script as ``python`` does: in ``__main__``, through ``runpy`` for ``-m``. Its
exceptions and ``SystemExit`` leave through the interpreter's own top level, so its exit status,
its uncaught traceback, its atexit handlers and the joining of its threads are the interpreter's.

:func:`run` answers as ``subprocess.run(command, capture_output=True, text=True, ...)`` does, and
*is* ``subprocess.run`` where a fresh interpreter could differ: a command of another form (``-c``,
an interpreter option), an environment that differs from the zygote's in a variable that may be
read as an interpreter or torch starts (see ``PER_RUN``), or ``TENSORDBG_TESTS_FRESH=1`` in the
tests' environment (every run a fresh interpreter, to compare). A test that signals the process,
talks to its stdin, times its start or checks what a fresh interpreter imports keeps
``subprocess`` itself, and so does a plain ``python`` run that a test takes as the reference of
what python does.

>>> done = run([sys.executable, "-m", "tensordbg.cli", "run", "train.py"], cwd=tmp_path,
...            env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=120)
"""

from __future__ import annotations

import contextlib
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ("torch", "tensordbg.api", "tensordbg.integrations.runner", "tensordbg.dump",
           "tensordbg.offline.commands", "tensordbg.rules")  # fmt: skip
"""What ``tensordbg run`` imports before the script runs (no module the fork then runs)."""

PER_RUN = ("TENSORDBG_", "PYTEST_", "KINETO_LOG_LEVEL")
"""Variables that may differ from the zygote's: read as the process runs, not as it starts
(``grep -rn environ tensordbg/``: the runtime directory, the run id, full tracebacks; Kineto's
log level, which tensordbg's profiler sets in the tests' process, is read as a profiler first
starts). Any other variable must be the zygote's, or one its imports set to the value they
would set (torch's compiler cache, TORCHINDUCTOR_CACHE_DIR, which torch also sets in the tests'
process)."""

FRESH_MAIN = {"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
              "__builtins__"}  # fmt: skip
"""What ``__main__`` holds before python runs a module or script in it."""


def run(command: Sequence[str], *, cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run(command, cwd=cwd, env=env, timeout=timeout, capture_output=True,
    text=True)``, forked from the zygote where that is the same (see the module's doc)."""
    command = [os.fspath(word) for word in command]
    env = dict(os.environ if env is None else env)
    argv = _python_argv(command, os.fspath(cwd or os.getcwd()))
    if argv is None or os.environ.get("TENSORDBG_TESTS_FRESH") == "1" or not _lock.acquire(False):
        return _subprocess(command, cwd, env, timeout)
    try:
        zygote = _zygote_for(env)
        if zygote is None:
            return _subprocess(command, cwd, env, timeout)
        return zygote.run(command, argv, os.fspath(cwd or os.getcwd()), env, timeout)
    finally:
        _lock.release()


def close() -> None:
    """End this process's zygote, if it has one (it also ends when this process does)."""
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


def _subprocess(command: list[str], cwd, env, timeout) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, timeout=timeout, capture_output=True,
                          text=True)  # fmt: skip


def _python_argv(command: list[str], cwd: str) -> list[str] | None:
    """``["-m", module, *args]`` or ``[script, *args]`` of ``python ...``; None for another
    command, or one with interpreter options."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) > 2:
        return command[1:]
    if command[1].endswith(".py") and os.path.isfile(os.path.join(cwd, command[1])):
        return command[1:]
    return None


_lock = threading.Lock()
_zygote: _Zygote | None = None


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    """The zygote, started with ``env`` if there is none; None if ``env`` needs a fresh
    interpreter."""
    global _zygote
    if _zygote is not None and not _zygote.alive():
        _zygote.close()
        _zygote = None
    if _zygote is None:
        _zygote = _Zygote(env)
    started, preloaded = _zygote.env, _zygote.preloaded
    for name in {*env, *started, *preloaded}:
        if not name.startswith(PER_RUN) and env.get(name) not in (started.get(name),
                                                                  preloaded.get(name)):  # fmt: skip
            return None
    return _zygote


class _Zygote:
    def __init__(self, env: dict[str, str]):
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (its stderr: nothing, or why it died)
        boot = BOOT.format(tests=str(Path(__file__).parent), fd=theirs.fileno())
        self.process = subprocess.Popen([sys.executable, "-c", boot], env=env,
                                        pass_fds=[theirs.fileno()], stdout=subprocess.DEVNULL,
                                        stderr=self.log)  # fmt: skip
        theirs.close()
        self.control = ours
        try:
            ready = self._receive(120)
        except (TimeoutError, RuntimeError):
            ready = {}
        said = self._said()  # a fresh interpreter would print it at every run
        if set(ready) != {"ready"} or said:
            self.close()
            raise RuntimeError(f"the tests' zygote did not start, or said something: {said}")
        self.preloaded: dict[str, str] = ready["ready"]  # its environment once it had imported

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, command, argv, cwd, env, timeout) -> subprocess.CompletedProcess:
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid, in_step = None, False  # in step: the zygote owes no message
        try:
            try:
                socket.send_fds(self.control, [request], [out_w, err_w])
            finally:
                os.close(out_w)
                os.close(err_w)
            pid = self._receive(60)["pid"]
            deadline = None if timeout is None else time.monotonic() + timeout
            out, err, ended = _read(out_r, err_r, deadline)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            # Pipes still open at the deadline: the child may have ended, a process it started
            # holding them; or they ended and the child runs on.
            done = self._receive(left if ended else 0.001, quiet=True)
            if done is None:  # as subprocess.run: killed, and the output so far
                os.kill(pid, signal.SIGKILL)
                self._receive(60)
            in_step = True
            if done is None or not ended:
                raise subprocess.TimeoutExpired(command, timeout, out or None, err or None)
            return subprocess.CompletedProcess(command, done["returncode"], _text(out),
                                               _text(err))  # fmt: skip
        except BaseException:
            if not in_step:  # interrupted (by pytest-timeout, say): the child goes too, and
                if pid is not None:  # the zygote, owed a message: the next run starts another
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                close()
            raise
        finally:
            os.close(out_r)
            os.close(err_r)

    def _receive(self, timeout: float | None, quiet: bool = False) -> dict | None:
        self.control.settimeout(timeout)
        try:
            message = self.control.recv(1 << 20)
        except TimeoutError:
            if quiet:
                return None
            raise
        if not message:
            raise RuntimeError(f"the tests' zygote died: {self._said()}")
        return json.loads(message)

    def _said(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        self.control.close()  # the zygote ends at the end of its socket
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _read(out_fd: int, err_fd: int, deadline: float | None) -> tuple[bytes, bytes, bool]:
    """Both pipes to their ends, or until ``deadline``: (stdout, stderr, whether both ended)."""
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            for key, _ in selector.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
        done = not selector.get_map()
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd]), done


def _text(data: bytes) -> str:
    """As ``subprocess`` decodes with ``text=True``."""
    text = data.decode("utf-8" if sys.flags.utf8_mode else locale.getencoding())
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --- in the zygote ------------------------------------------------------------------------------

BOOT = """\
import sys; sys.path[0] = {tests!r}; import zygote
try:
    zygote._child(*zygote._serve({fd}))
except BaseException:
    __import__("zygote")._from_the_top()
    raise
"""
"""The zygote's program (``python -c``), whose top level is the child's: an exception leaves
there as from the top of ``python -m``'s or a script's, once :func:`_from_the_top` has taken
this program's frames out of its traceback."""


def _from_the_top() -> None:
    """Leave the frames of this program out of the traceback of the exception being handled: an
    uncaught one is printed from the frame python's own would start at, ``runpy``'s or the
    script's, and a ``raise`` in an ``except`` block adds no frame."""
    error = sys.exc_info()[1]
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ("<string>", __file__):
        tb = tb.tb_next
    error.__traceback__ = tb


def _serve(fd: int) -> tuple[dict, list[int]]:
    """Preload, then fork a child for each request; returns in a child only, with its request.
    The zygote itself exits when the tests' end of the socket closes."""
    import gc
    import importlib

    control = socket.socket(fileno=fd)
    gc.disable()  # as the gc module's doc says for a process that forks without exec
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # its modules' objects: a child's collections and its exit leave their pages
    control.send(json.dumps({"ready": dict(os.environ)}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        except OSError:
            message = b""
        if not message:
            sys.exit(0)
        pid = os.fork()
        if pid == 0:
            control.close()
            gc.enable()
            return json.loads(message), fds
        for received in fds:
            os.close(received)
        control.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        control.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict, fds: list[int]) -> None:
    """Become ``python *argv`` in ``cwd`` with ``env``; what it raises leaves as python's."""
    import runpy

    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()  # a fresh interpreter seeds it from the system, each its own
    main = sys.modules["__main__"]
    for name in set(vars(main)) - FRESH_MAIN:
        delattr(main, name)
    argv = request["argv"]
    sys.orig_argv = [sys.executable, *argv]
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[1])  # what python -m calls: sys.argv[0], __main__
        return
    from importlib.machinery import SourceFileLoader

    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    main.__file__, main.__cached__ = script, None
    main.__loader__ = SourceFileLoader("__main__", script)
    code = compile(Path(script).read_bytes(), script, "exec", dont_inherit=True)
    exec(code, vars(main))
