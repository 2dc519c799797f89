"""`make results`: the whole study in one command, each part a row of its own.

    python -m tools.study                       # CUDA: the gpu profile (~18 min, H100)
    python -m tools.study --device cpu          # the same study, tiny, on the CPU
    python -m tools.study --parts pool --set pool.batches=64 --dry-run
    python -m tools.study --parts report --name 2026-11-30_h100-80gb-hbm3

Raw results go to runs/results/<name>/<part>/ (its sweeps, benchmark tables, logs and a
status.json); the view, docs/results/<name>/ (results.md with every table, and memtrain-report's
summary.csv, report.md and figures/), is made again from all raw results at the end of every
invocation, so parts run in several invocations (or on several machines, their archives unpacked
over each other) end in one view. A part that fails or times out is recorded as such and the
next part runs. `--archive FILE` packs raw results and view into one .tar.gz after every part,
so a killed study still leaves what it measured. Sizes: tools/study/plan.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from memtrain.record import atomic_write
from tools.study import plan, view

STATUS = "status.json"
VIEW_RESERVE_S = 60  # of a deadline, kept for the view and the archive
# the command running now, and the signal that asked the study to stop (SIGTERM, Ctrl-C)
_CHILD: list[subprocess.Popen] = []
_STOP: list[int] = []


def _forward(signum, frame) -> None:
    """Stop the study: the running command gets the signal (memtrain then checkpoints and
    writes `interrupted` rows), no further step starts, what was measured is kept."""
    _STOP.append(signum)
    for child in _CHILD:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)


def device_slug(device: str) -> str:
    """`cpu`, or the GPU's name in lower case (`h100-80gb-hbm3`); a CUDA request without CUDA
    is a one-line error, exit 2."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        print("results: no CUDA device here; `make results DEVICE=cpu` runs the study at CPU "
              "size", file=sys.stderr)
        raise SystemExit(2)
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def find_none(runs: Path, where: dict) -> bool:
    """Is there an ok `none` run of the baseline part with these column values?"""
    for path in (runs / "baseline").glob("*/*/summary.json"):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if row.get("status") == "ok" and row.get("method") == "none" and \
                all(str(row.get(k)) == str(v) for k, v in where.items()):
            return True
    return False


def run_step(step: plan.Step, log: Path, timeout: float, env: dict) -> dict:
    """Run one command (its own process group, so that it can be stopped with all its workers;
    output to `log`); on timeout SIGTERM the group (memtrain turns it into `interrupted` rows),
    then SIGKILL what is left."""
    argv = [sys.executable, *step.argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        # a group, not a session: whatever ends this session's processes ends it too
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=os.setpgrp)
        _CHILD.append(proc)
        status, rc = None, -signal.SIGKILL
        try:
            rc = proc.wait(timeout=timeout)
            if _STOP:
                status = f"stopped by signal {_STOP[0]}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout:.0f} s"
            for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    rc = proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    rc = proc.wait()
                    break
        finally:
            _CHILD.clear()
    return {"name": step.name, "command": " ".join(["python", *step.argv]),
            "status": status or ("ok" if rc == 0 else f"failed (exit {rc})"), "rc": rc,
            "seconds": round(time.monotonic() - t0, 1), "budget_s": step.budget_s,
            "log": str(log)}


def run_part(part: str, ctx: plan.Context, env: dict, time_left) -> dict:
    """Every step of a part, each recorded; a failing step never stops the next."""
    folder = ctx.runs / part
    if folder.exists():  # a part measured again starts clean: no stale rows
        import shutil

        shutil.rmtree(folder)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    sizes = {k: ctx.size[k] for k in ("study", "resnet50", part)}  # what this part ran at
    record = {"part": part, "status": "running", "started": started, "size": sizes,
              "steps": []}
    atomic_write(folder / STATUS, json.dumps(record, indent=1) + "\n")
    try:
        steps = plan.BUILDERS[part](ctx)
    except Exception as e:  # a bad size: the part's row says so, the study goes on
        steps, record["error"] = [], f"{type(e).__name__}: {e}"
    for step in steps:
        left = time_left()
        if left < 30 or _STOP:
            why = "stopped by signal" if _STOP else "deadline"
            record["steps"].append({"name": step.name, "status": f"skipped ({why})",
                                    "budget_s": step.budget_s, "seconds": 0})
            continue
        timeout = min(ctx.size["study"]["timeout_factor"] * step.budget_s + 120, left)
        print(f"results: {part}/{step.name} (budget ~{step.budget_s:.0f} s, timeout "
              f"{timeout:.0f} s)", flush=True)
        record["steps"].append(run_step(step, folder / f"{step.name}.log", timeout, env))
        print(f"results: {part}/{step.name}: {record['steps'][-1]['status']} in "
              f"{record['steps'][-1]['seconds']} s", flush=True)
    bad = [s["status"] for s in record["steps"] if s["status"] != "ok"]
    record["status"] = "failed: " + record["error"] if "error" in record else \
        (bad[0] if bad else "ok")
    record["seconds"] = round(sum(s["seconds"] for s in record["steps"]), 1)
    record["budget_s"] = sum(s["budget_s"] for s in record["steps"])
    atomic_write(folder / STATUS, json.dumps(record, indent=1) + "\n")
    return record


def pack(path: Path, folders: list[Path]) -> None:
    """One .tar.gz of the folders, written atomically, paths relative to the working directory
    (so it unpacks over a checkout) or, for a folder outside it, its name; large binaries
    (weights, resume checkpoints, memory snapshots) left out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    skip = (".pt", ".pickle")
    with tarfile.open(tmp, "w:gz") as tar:
        for folder in folders:
            rel = os.path.relpath(folder)
            if folder.exists():
                tar.add(folder, arcname=folder.name if rel.startswith("..") else rel,
                        filter=lambda ti: None if ti.name.endswith(skip) else ti)
    os.replace(tmp, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.study",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--profile", choices=tuple(plan.PROFILES),
                    help="sizes (default: gpu on cuda, cpu on cpu)")
    ap.add_argument("--parts", default=",".join(plan.PARTS),
                    help=f"comma list of {', '.join(plan.PARTS)}, report (default: all; the "
                         f"report is made after any of them)")
    ap.add_argument("--call", type=int, choices=range(1, len(plan.CALLS) + 1),
                    help="the parts of one device-tool call of the GPU run (instead of "
                         "--parts): " + "; ".join(f"{i}: {c}" for i, c in
                                                  enumerate(plan.CALLS, 1)))
    ap.add_argument("--set", action="append", default=[], metavar="PART.KEY=VALUE",
                    help="change one size, e.g. pool.batches=64 (repeatable)")
    ap.add_argument("--name", help="folder name (default: <date>_<gpu or cpu>)")
    ap.add_argument("--out", type=Path, help="the view (default: docs/results/<name>)")
    ap.add_argument("--runs", type=Path, help="raw results (default: runs/results/<name>)")
    ap.add_argument("--archive", type=Path, help="also pack raw results and view into this .tar.gz")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no step after this many seconds; a running step is stopped at it")
    ap.add_argument("--no-report", action="store_true", help="leave the view as it is")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and budgets only")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    chosen = plan.CALLS[a.call - 1] if a.call else a.parts
    parts = [p.strip() for p in chosen.split(",") if p.strip()]
    wrong = [p for p in parts if p not in (*plan.PARTS, "report")]
    if wrong or not parts:
        print(f"results: unknown part {', '.join(wrong) or '(none)'}; valid: "
              f"{', '.join(plan.PARTS)}, report", file=sys.stderr)
        return 2
    profile = a.profile or ("gpu" if a.device == "cuda" else "cpu")
    try:
        size = plan.apply_sets(plan.PROFILES[profile], a.set)
    except ValueError as e:
        print(f"results: {e}", file=sys.stderr)
        return 2
    measuring = [p for p in plan.PARTS if p in parts]
    # the folder is named by the GPU; a measuring run checks that there is one
    slug = a.device if a.dry_run else \
        device_slug(a.device) if measuring or not a.name else None
    name = a.name or f"{datetime.date.today().isoformat()}_{slug}"
    out, runs = a.out or Path("docs/results") / name, a.runs or Path("runs/results") / name
    if a.dry_run:
        ctx = plan.Context(a.device, runs, size, lambda where: "baseline" in parts)
        return dry_run(ctx, measuring)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # the GPU tests check compiled kernels
    else:  # one torch thread unless asked: on a shared CPU, OpenMP threads that wait for
        # each other made steps ~20x slower (resnet50 16 px b2: 1.2 s with one, 23-31 s with
        # two, at load ~13 on 2 cores); the CPU study measures memory, time is only a sign
        env.setdefault("OMP_NUM_THREADS", "1")
    ctx = plan.Context(a.device, runs, size, lambda where: find_none(runs, where))
    t0 = time.monotonic()
    reserve = 0 if a.no_report else VIEW_RESERVE_S
    time_left = (lambda: float("inf")) if a.deadline_s is None else \
        (lambda: a.deadline_s - reserve - (time.monotonic() - t0))
    print(f"results: {name}: parts {', '.join(measuring) or '(none)'}, sizes {profile}, "
          f"raw results in {runs}, view in {out}", flush=True)
    runs.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    for part in measuring:
        if _STOP or time_left() < 30:  # not started: its earlier results, if any, stay
            print(f"results: {part}: not started ({'signal' if _STOP else 'deadline'})",
                  flush=True)
            continue
        run_part(part, ctx, env, time_left)
        if a.archive:
            pack(a.archive, [runs, out])
    if _STOP:  # asked to stop: keep what was measured, leave the view to a later `report`
        print(f"results: stopped by signal {_STOP[0]}; raw results in {runs}", file=sys.stderr)
        return 128 + _STOP[0]
    if not a.no_report:
        view.make(runs, out, env)
        if a.archive:
            pack(a.archive, [runs, out])
    print(f"results: done in {time.monotonic() - t0:.0f} s -> {out / 'results.md'}")
    return 0


def dry_run(ctx: plan.Context, parts: list[str]) -> int:
    total = 0.0
    for part in parts:
        steps = plan.BUILDERS[part](ctx)
        budget = sum(s.budget_s for s in steps)
        total += budget
        print(f"## {part}: ~{budget:.0f} s")
        for s in steps:
            print(f"  [{s.budget_s:.0f} s] python {' '.join(s.argv)}")
    print(f"total ~{total:.0f} s ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
