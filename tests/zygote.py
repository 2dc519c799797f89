"""`memtrain` commands forked from a warm interpreter: the tests' processes without the imports.

A `memtrain` process spends about 4 of its 5-6 CPU-seconds importing torch (and, through the
first optimizer, torch's compiler), Hydra and memtrain before it reads its command line. The
tests start dozens of them for what only a process shows (exit statuses, what it prints, the
folders it leaves). `Zygote` is one interpreter per test worker that has imported all that and
runs no torch op; each command is a child forked from it, with the test's working folder,
environment and output files, that runs `python -m memtrain ARGS` as the interpreter would
(`runpy`, `__main__` included) and exits with its status. Its exit status, stdout and stderr
are a fresh process's: only the import time is shared (and that of composing the tests'
most common options, from caches keyed by the config files' contents).

`run()` falls back to a real subprocess where forking would differ from one: under coverage
(its subprocess patch measures fresh interpreters), or when the command's environment changes
a variable that the preloaded modules read at import (torch's, Triton's, OpenMP's, Python's).

`python()` is an executable that stands in for the interpreter where a test starts
`python -m memtrain ...` itself (torchrun's ranks through its `PYTHON_EXEC`, a command the test
signals): a few lines of Python without site packages that hand their own standard streams,
folder, environment and arguments to the zygote, forward every signal they get to the forked
child, and exit as it did (by the same signal where it was killed); when they are killed
themselves, the zygote kills the child. The command's `sys.executable` is the stand-in, as
a real interpreter started by that path would have it, so the job processes submitit starts
with it (`python -u -m submitit.core._submit`: a SLURM job, a local launcher's job) come
through the stand-in and are forked too. Any other command line, or an environment the zygote
cannot take, runs the real interpreter instead.

Run as a script, this file is the server: it reads requests (a JSON line of argv, folder and
environment, with the output files' descriptors) from the socket whose descriptor its parent
passes as its argument, and those of the stand-in interpreters from a listening socket.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

# variables the preloaded modules read when imported: a command that changes one runs fresh
# (TMPDIR is not one: no preloaded module asks for the temporary folder once Inductor's cache
# folder is set, which tests/conftest.py does, so a child asks afresh; `serve` checks it)
IMPORT_TIME = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL", "KMP_", "CUDA", "NVIDIA", "PYTHON",
               "LD_", "MALLOC", "MPL")
# of those, what is read only when it is used, not at import: torchrun's interpreter and the
# variables its agent gives each rank, and Inductor's cache folder (which torch writes into the
# environment of a process once it first asks for it: a test worker that compiled, or built a
# DDP model, has it set from then on); and PYTHONUNBUFFERED, read at start-up: the zygote's
# streams are unbuffered, so a command without it writes what a fresh interpreter would, only
# no later
RUN_TIME = ("PYTHON_EXEC", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCHINDUCTOR_CACHE_DIR", "PYTHONUNBUFFERED")
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "torch.utils.data", "torch.distributed.run",
           "torch.distributed._tools.mem_tracker", "scipy.optimize", "pandas",
           "hydra", "hydra.main", "omegaconf", "hydra_plugins.memtrain_launcher", "memtrain.cli",
           "memtrain.run.runner", "memtrain.run.train", "memtrain.optim",
           "memtrain.hydra_callbacks", "memtrain.report.build", "memtrain.report.callback",
           "memtrain.report.command", "memtrain.report.plots", "submitit.core.submission")
# the modules a forked command may run (`python -m MODULE`)
MODULES = ("memtrain", "torch.distributed.run")


def differs(env: dict[str, str], base: dict[str, str]) -> str | None:
    """The first variable read at import time that `env` sets otherwise than `base`, if any."""
    for k in sorted(set(env) | set(base)):
        if k.startswith(IMPORT_TIME) and not k.startswith(RUN_TIME) and env.get(k) != base.get(k):
            return k
    return None


# the modules a stand-in interpreter forks (`python [-u] -m MODULE`): memtrain, the job
# process submitit starts for a launcher's job (with the sweep's interpreter, the stand-in
# where the sweep was started through it), and memtrain-report (the results view's)
STAND_IN_MODULES = ("memtrain", "submitit.core._submit", "memtrain.report.command")

# The stand-in interpreter: run with the real one's -S -E (no site packages, no PYTHON*
# variables: it starts in milliseconds); argv[1] is the zygote's socket address, argv[2] the
# real interpreter, argv[3] the stand-in's own path (the forked command's sys.executable, as a
# real interpreter started by that path would have it), the rest the command line it was given.
SHIM = r"""
import json, os, signal, socket, sys
address, real, executable, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# -u: torchrun's and submitit's unbuffered output, the zygote's too
rest = args[1:] if args[:1] == ["-u"] else args
sock = None
if rest[:1] == ["-m"] and rest[1:2] and rest[1] in __MODULES__:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect("\0" + address)
        request = {"module": rest[1], "argv": rest[2:], "cwd": os.getcwd(),
                   "env": dict(os.environ), "executable": executable}
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = json.loads(sock.makefile().readline() or "{}")
    except OSError:
        reply = {}
    if "pid" not in reply:
        sock.close()
        sock = None
if sock is None:  # not a command the zygote runs: the real interpreter
    os.execv(real, [real, *args])
pid = reply["pid"]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2):
    signal.signal(sig, lambda s, _: os.kill(pid, s))
line = sock.makefile().readline()
code = json.loads(line)["status"] if line else 1
if code < 0:  # killed by a signal: so is this process
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code if code >= 0 else 128 - code)
""".replace("__MODULES__", repr(STAND_IN_MODULES))


class Zygote:
    """The warm interpreter of one test worker, started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._buf = b""
        self.broken: str | None = None
        self._python: str | None = None

    def _start(self) -> None:
        import tempfile

        ours, theirs = socket.socketpair()
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # the listening socket of the stand-in interpreters: an abstract address (Linux), so
        # no file to clean up and no limit on the temporary folder's path length
        self.address = f"memtrain-zygote-{os.getpid()}-{os.urandom(4).hex()}"
        # the server's own output: why it failed, if it does
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (open while the server lives)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), self.address], env=self._env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        theirs.close()
        self._sock, self._buf = ours, b""
        if self._line(timeout=300) != "ready":
            self._log.seek(0)
            self.broken = self._log.read()[-2000:] or "the zygote did not start"

    def _line(self, timeout: float | None = None) -> str:
        """The server's next line (TimeoutError after `timeout` seconds; '' once it is gone)."""
        self._sock.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                chunk = self._sock.recv(4096)
                if not chunk:
                    return ""
                self._buf += chunk
        finally:
            self._sock.settimeout(None)
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def usable(self, env: dict[str, str]) -> bool:
        """Whether a command of environment `env` may be forked here (else: a subprocess)."""
        if "coverage" in sys.modules:
            import coverage

            if coverage.Coverage.current() is not None:
                return False
        if self._proc is None:
            self._start()
        if self.broken or self._proc.poll() is not None:
            return False
        return differs(env, self._env) is None

    def python(self) -> str:
        """The stand-in interpreter's path (module docstring), written on first use; the real
        interpreter where the zygote cannot serve (not Linux, coverage, a failed start)."""
        if sys.platform != "linux" or not self.usable(dict(os.environ)):
            return sys.executable
        if self._python is None:
            import tempfile

            folder = Path(tempfile.mkdtemp(prefix="memtrain-zygote-"))
            (folder / "shim.py").write_text(SHIM)
            script = folder / "python"
            # a shell script that execs the interpreter: the same process, so its pid is the
            # one the caller signals
            script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{folder / "shim.py"}" '
                              f'"{self.address}" "{sys.executable}" "{script}" "$@"\n')
            script.chmod(0o755)
            self._python = str(script)
        return self._python

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            module: str = "memtrain") -> subprocess.CompletedProcess:
        """`python -m MODULE ARGS` in a child: as `subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)` gives it (TimeoutExpired after killing the child)."""
        import tempfile

        assert module in MODULES, module
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            with open(out, "w") as o, open(err, "w") as e:
                request = json.dumps({"module": module, "argv": args, "cwd": str(cwd),
                                      "env": env}).encode()
                socket.send_fds(self._sock, [request + b"\n"], [o.fileno(), e.fileno()])
            pid = json.loads(self._line() or self._died())["pid"]
            cmd = [sys.executable, "-m", module, *args]
            try:
                status = json.loads(self._line(timeout) or self._died())["status"]
            except TimeoutError:
                os.kill(pid, 9)
                self._line()  # the killed child's status
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(),
                                                err.read_text()) from None
            return subprocess.CompletedProcess(cmd, status, out.read_text(), err.read_text())

    def _died(self) -> str:
        self._log.seek(0)
        self.broken = self._log.read()[-2000:] or "the zygote ended"
        raise RuntimeError(f"the tests' zygote (tests/zygote.py) ended: {self.broken}")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._sock.close()  # the server's read ends: it exits
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._log.close()
        if self._python is not None:  # the stand-in's folder
            import shutil

            shutil.rmtree(Path(self._python).parent, ignore_errors=True)
            self._python = None


def _child(request: dict, fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become `python -m MODULE ARGS` in the request's folder and
    environment, its standard streams `fds` (stdin, stdout, stderr; stdout and stderr alone: no
    input), then exit with its status. `keep_closed`: the server's sockets."""
    import runpy
    import signal
    import traceback

    if len(fds) == 2:
        fds = [os.open(os.devnull, os.O_RDONLY), *fds]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in {*fds, *keep_closed} - {0, 1, 2}:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile

    tempfile.tempdir = None  # the temporary folder of the child's environment, asked afresh
    module = request.get("module", "memtrain")
    sys.argv = [module, *request["argv"]]
    if request.get("executable"):  # started through the stand-in: its path, as an interpreter's
        sys.executable = request["executable"]
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter turns it into a status
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at exit, in its order: threads (and what they registered
        # to run when they end: loky's executor shuts its workers down there), then atexit
        import atexit

        threading._shutdown()
        atexit._run_exitfuncs()
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(server: int, address: str) -> None:
    """Fork a child per request, of the test worker (its socket, one at a time) and of the
    stand-in interpreters (a connection each, any number at once); send each its child's pid,
    then its exit status. A stand-in's connection that ends before its child: the child is
    killed (the stand-in was, by a signal it cannot forward)."""
    import contextlib
    import importlib
    import selectors
    import signal
    import tempfile

    base = dict(os.environ)  # before the imports, some of which set variables (torch's CUDA ones)
    for name in PRELOAD:
        importlib.import_module(name)
    from memtrain.run import provenance

    provenance.own_commit()  # read once here (two git commands): every child's row shares it
    from memtrain.config import loader

    # The checks of the tests' most common command, composed once here: a child's composition
    # of the same options (the defaults tree, each option alone) comes from loader's caches,
    # which are keyed by the config files' contents, as a fresh process would compose it.
    loader.check_overrides(["trainer=smoke", "model=mlp6"], multirun=None)
    import gc

    # what the imports made, out of the cycle collector's reach: a child's collections neither
    # walk it (hundreds of thousands of objects) nor write to its pages (copied on write)
    gc.collect()
    gc.freeze()
    if tempfile.tempdir is not None:  # a module kept the temporary folder: children would too
        raise SystemExit("a preloaded module asked for the temporary folder at import; "
                         "TMPDIR would have to be a variable read at import (IMPORT_TIME)")
    worker = socket.socket(fileno=server)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + address)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(worker, selectors.EVENT_READ, "worker")
    sel.register(listener, selectors.EVENT_READ, "listener")
    # a child's end wakes the loop: SIGCHLD writes a byte to this pipe
    ended, ends = os.pipe()
    os.set_blocking(ends, False)
    signal.set_wakeup_fd(ends)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel.register(ended, selectors.EVENT_READ, "ended")
    owner: dict[int, socket.socket] = {}  # a running child's pid: where its status goes
    child_of: dict[socket.socket, int] = {}  # a stand-in's connection: its child's pid
    worker.sendall(b"ready\n")
    buf = b""

    def fork(request: dict, fds: list[int], to: socket.socket) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # every socket and pipe of the server's, its stand-ins' connections included
            _child(request, fds, [ends, *(key.fd for key in sel.get_map().values())])
        for fd in fds:
            os.close(fd)
        owner[pid] = to
        if to is not worker:
            child_of[to] = pid
        to.sendall(json.dumps({"pid": pid}).encode() + b"\n")

    def drop(conn: socket.socket) -> None:
        sel.unregister(conn)
        child_of.pop(conn, None)
        conn.close()

    while True:
        for key, _ in sel.select():
            if key.data == "ended":
                os.read(ended, 4096)
            elif key.data == "worker":
                msg, fds, _, _ = socket.recv_fds(worker, 1 << 20, 2)
                if not msg:
                    return
                buf += msg
                if not buf.endswith(b"\n"):
                    for fd in fds:
                        os.close(fd)
                    continue
                request, buf = json.loads(buf), b""
                fork(request, fds, worker)
            elif key.data == "listener":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "stand-in")
            elif key.fileobj in child_of:  # the stand-in ended before its child: kill it
                pid = child_of[key.fileobj]
                if not key.fileobj.recv(1):
                    os.kill(pid, signal.SIGKILL)
                    drop(key.fileobj)
            else:  # a stand-in's request: one line, its three standard streams
                conn = key.fileobj
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(msg) if msg.endswith(b"\n") and len(fds) == 3 else None
                if request is None or request.get("module") not in STAND_IN_MODULES or \
                        differs(request["env"], base) is not None:
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"{}\n")  # the stand-in runs the real interpreter
                    drop(conn)
                    continue
                fork(request, fds, conn)
        while owner:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            to = owner.pop(pid, None)
            if to is None:
                continue
            reply = json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode()
            with contextlib.suppress(OSError):  # a stand-in gone meanwhile
                to.sendall(reply + b"\n")
            if to is not worker and to in child_of:
                drop(to)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
