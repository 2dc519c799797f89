"""A throwaway one-node SLURM cluster for the tests: its own munged, slurmctld and slurmd.

Everything lives in one temporary folder (slurm.conf, munge key and socket, state, spool, logs,
pid files); the ports are picked free, so two copies (two xdist workers, two people on one
machine) never meet. `stop()` cancels the jobs, ends every process that carries this cluster's
SLURM_CONF in its environment (the daemons, slurmstepd, the jobs) and removes the folder.

Without slurmdbd (a database server) SLURM has no accounting, and `sacct`, which submitit polls
to learn that a job ended without a result (cancelled while pending, killed), only says
"accounting storage is disabled". The cluster puts a small `sacct` first on PATH that answers
submitit's one query (`-o JobID,State,NodeList --parsable2 -j ID`) from `scontrol show job`,
the controller's own record of every job (kept for MinJobAge seconds).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
PARTITION = "debug"
# The tests' node size, fixed so that what runs and what waits does not depend on the machine
TEST_CPUS = 2

SACCT = '''#!{python}
"""sacct for a cluster without accounting: the job states, read from `scontrol show job`."""
import subprocess, sys

args = sys.argv[1:]
fields = args[args.index("-o") + 1].split(",") if "-o" in args else ["JobID", "State"]
wanted = {{args[i + 1] for i, a in enumerate(args) if a == "-j"}}
out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True).stdout
print("|".join(fields))
for line in out.splitlines():
    job = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    main = job.get("ArrayJobId", job.get("JobId", ""))
    if wanted and main not in wanted:
        continue
    task = job.get("ArrayTaskId", "").split("%")[0]
    jid = main if not task else f"{{main}}_{{task}}" if task.isdigit() else f"{{main}}_[{{task}}]"
    row = {{"JobID": jid, "State": job.get("JobState", ""), "NodeList": job.get("NodeList", "")}}
    print("|".join(row.get(f, "") for f in fields))
'''


def missing() -> list[str]:
    """The SLURM and munge programs this machine lacks."""
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (held together while picked, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In a daemon's child process: killed when the test process dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine, one node with its CPUs, one partition.

    Args:
        root: the folder for everything (removed by `stop`); a fresh temporary one by default.
        cpus: CPUs of the node (default: this machine's).
    """

    def __init__(self, root: Path | None = None, cpus: int | None = None):
        # short paths: unix socket names are limited to 108 bytes
        self.root = Path(root or tempfile.mkdtemp(prefix="mt-slurm-", dir="/tmp"))
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.node = f"n{os.getpid()}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf),
                    "PATH": f"{self.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}

    # ------------------------------------------------------------ start

    def start(self, timeout: float = 60, tries: int = 3) -> SlurmCluster:
        """Start the daemons and wait until the node takes jobs; retries with other ports when
        one was taken between picking and binding."""
        for d in ("munge", "state", "spool", "log", "bin"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)
        self._write_sacct()
        self._start_munge()
        for attempt in range(tries):
            self._write_conf(*free_ports(2))
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
            try:
                self._wait_idle(timeout)
                return self
            except RuntimeError:
                for name in ("slurmd", "slurmctld"):
                    self._end(self.procs.pop(name))
                if attempt == tries - 1:
                    raise
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.root / "munge"
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={m / 'sock'}",
                               f"--key-file={key}", f"--pid-file={m / 'pid'}",
                               f"--log-file={m / 'log'}", f"--seed-file={m / 'seed'}"])
        deadline = time.monotonic() + 30
        while not (m / "sock").exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(m / 'log')}")
            time.sleep(0.05)

    def _write_conf(self, ctld_port: int, slurmd_port: int) -> None:
        r = self.root
        host = socket.gethostname().split(".")[0]
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        self.conf.write_text(f"""\
ClusterName=mt{os.getpid()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={r / 'munge' / 'sock'},cred_expire=10
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
# look at pending jobs every 2 s, not 60: a requeued job starts once its wait is over
SchedulerParameters=sched_interval=2
ReturnToService=2
# finished jobs stay visible to `scontrol show job` (the sacct stand-in) through a session
MinJobAge=3600
# SIGKILL 10 s after SIGTERM (scancel, a time limit) rather than 30
KillWait=10
NodeName={self.node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={self.cpus} \
RealMemory={mem_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _write_sacct(self) -> None:
        sacct = self.root / "bin" / "sacct"
        sacct.write_text(SACCT.format(python=sys.executable))
        sacct.chmod(0o755)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (lives with the daemon)
        self.procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {self.logs()}")
            state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the node did not come up in {timeout:.0f} s: {self.logs()}")

    # ------------------------------------------------------------ use

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check,
                              timeout=60)

    def jobs(self) -> list[dict[str, str]]:
        """Every job the controller knows (`scontrol show job`), one dict per job or task."""
        out = self.run("scontrol", "show", "job", "-o", check=False).stdout
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                for line in out.splitlines() if line.startswith("JobId=")]

    def wait_for(self, what: str, test, timeout: float = 300, every: float = 0.5):
        """Poll `test()` until it returns something true; fail naming `what`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = test()
            if got:
                return got
            time.sleep(every)
        raise TimeoutError(f"waited {timeout:.0f} s for {what}; jobs: {self.jobs()}")

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p.name}\n{self._tail(p, lines)}"
                         for p in sorted((self.root / "log").glob("*")))

    @staticmethod
    def _tail(path: Path, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """Cancel every job, end every process of this cluster, remove its folder."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", f"--user={os.geteuid()}", check=False)
            with contextlib.suppress(TimeoutError):
                self.wait_for("the jobs to end", lambda: not self._job_pids(), timeout=20)
        for name in ("slurmd", "slurmctld", "munged"):
            if name in self.procs:
                self._end(self.procs.pop(name))
        for pid in self._our_pids():  # a job step that outlived its slurmd
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _our_pids(self) -> list[int]:
        """Processes whose environment holds this cluster's SLURM_CONF: what the daemons
        started (slurmstepd, the jobs), this process excluded."""
        mark = f"SLURM_CONF={self.conf}".encode()
        own = {os.getpid()}
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in own:
                continue
            with contextlib.suppress(OSError):
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
        return pids

    def _job_pids(self) -> list[int]:
        """The processes of running jobs: ours, less the daemons and slurmctld's helper."""
        daemons = {p.pid for p in self.procs.values()}
        ctld = self.procs.get("slurmctld")
        jobs = []
        for pid in set(self._our_pids()) - daemons:
            with contextlib.suppress(OSError, ValueError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                if ctld is None or int(stat.rsplit(")", 1)[1].split()[1]) != ctld.pid:
                    jobs.append(pid)
        return jobs

    @staticmethod
    def _end(p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
