"""`memtrain` commands forked from a warm interpreter: the tests' processes without the imports.

A `memtrain` process spends about 4 of its 5-6 CPU-seconds importing torch (and, through the
first optimizer, torch's compiler), Hydra and memtrain before it reads its command line. The
tests start dozens of them for what only a process shows (exit statuses, what it prints, the
folders it leaves). `Zygote` is one interpreter per test worker that has imported all that and
runs no torch op; each command is a child forked from it, with the test's working folder,
environment and output files, that runs `python -m memtrain ARGS` as the interpreter would
(`runpy`, `__main__` included) and exits with its status. Its exit status, stdout and stderr
are a fresh process's: only the import time is shared.

`run()` falls back to a real subprocess where forking would differ from one: under coverage
(its subprocess patch measures fresh interpreters), or when the command's environment changes
a variable that the preloaded modules read at import (torch's, Triton's, OpenMP's, Python's).

Run as a script, this file is the server: it reads requests (a JSON line of argv, folder and
environment, with the output files' descriptors) from the socket whose descriptor its parent
passes as its argument.
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
IMPORT_TIME = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL", "KMP_", "CUDA", "NVIDIA", "PYTHON",
               "LD_", "MALLOC", "TMPDIR")
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "torch.utils.data", "hydra", "hydra.main",
           "omegaconf", "memtrain.cli", "memtrain.run.runner", "memtrain.run.train",
           "memtrain.optim", "memtrain.hydra_callbacks")


class Zygote:
    """The warm interpreter of one test worker, started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._buf = b""
        self.broken: str | None = None

    def _start(self) -> None:
        import tempfile

        ours, theirs = socket.socketpair()
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # the server's own output: why it failed, if it does
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (open while the server lives)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())], env=self._env,
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
        keys = set(env) | set(self._env)
        return not any(env.get(k) != self._env.get(k) for k in keys if k.startswith(IMPORT_TIME))

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float
            ) -> subprocess.CompletedProcess:
        """`python -m memtrain ARGS` in a child: as `subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)` gives it (TimeoutExpired after killing the child)."""
        import tempfile

        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            with open(out, "w") as o, open(err, "w") as e:
                request = json.dumps({"argv": args, "cwd": str(cwd), "env": env}).encode()
                socket.send_fds(self._sock, [request + b"\n"], [o.fileno(), e.fileno()])
            pid = json.loads(self._line() or self._died())["pid"]
            cmd = [sys.executable, "-m", "memtrain", *args]
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


def _child(request: dict, out: int, err: int, server: int) -> None:
    """In the forked child: become `python -m memtrain ARGS` in the request's folder and
    environment, then exit with its status."""
    import runpy
    import signal
    import traceback

    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in (devnull, out, err, server):
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["memtrain", *request["argv"]]
    code: int = 0
    try:
        runpy.run_module("memtrain", run_name="__main__", alter_sys=True)
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


def serve(server: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=server)
    sock.sendall(b"ready\n")
    buf = b""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            return
        buf += msg
        if not buf.endswith(b"\n"):
            for fd in fds:
                os.close(fd)
            continue
        request, buf = json.loads(buf), b""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, *fds, server)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        sock.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
