"""`make results`: the whole study in one command, each part a row of its own.

    python -m tools.study                       # CUDA: the gpu profile, priority parts first
    python -m tools.study --device cpu          # the same study, tiny, on the CPU
    python -m tools.study --parts pool --set pool.batches=64 --dry-run
    python -m tools.study --parts report --name 2026-11-30_h100-80gb-hbm3

Raw results go to runs/results/<name>/<part>/ (its sweeps, benchmark tables, logs and a
status.json); the view, docs/results/<name>/ (results.md with every table, and memtrain-report's
summary.csv, report.md and figures/), is made again from all raw results at the end of every
invocation, so parts run in several invocations (or on several machines, their archives unpacked
over each other) end in one view. A part that fails or times out is recorded as such and the
next part runs. `--archive FILE` packs raw results and view into one .tar.gz after every part,
so a killed study still leaves what it measured. Each part's record (its status, seconds
against budget, device, commit and the rows' schema version) is also written to
<view>/parts/<part>.json; a part complete there for this kind of device (any GPU, or the CPU)
and this schema is not measured again unless --remeasure names it. Parts run in priority
order (study_plan.PRIORITY); the rest start a step only where its budget still fits. Sizes:
tools/study/study_plan.py.
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

from memtrain.columns import SCHEMA, SCHEMA_VERSION
from memtrain.record import atomic_write
from tools.study import study_plan, view

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


def run_step(step: study_plan.Step, log: Path, timeout: float, env: dict,
             python: str = sys.executable) -> dict:
    """Run one command with the interpreter `python` (its own process group, so that it can be
    stopped with all its workers; output to `log`); on timeout SIGTERM the group (memtrain turns
    it into `interrupted` rows), then SIGKILL what is left."""
    argv = [python, *step.argv]
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


def commit() -> str | None:
    """The checkout's commit (MEMTRAIN_COMMIT where the copy has no git history)."""
    if os.environ.get("MEMTRAIN_COMMIT"):
        return os.environ["MEMTRAIN_COMMIT"]
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() or None if p.returncode == 0 else None


def complete(record: dict) -> bool:
    """Did every step of the part run to its end (a failing test is a measured result; a step
    skipped, timed out or stopped is not)?"""
    unfinished = ("skipped", "timeout", "stopped")
    return record.get("status") != "running" and "error" not in record and \
        bool(record.get("steps")) and \
        not any(str(s.get("status", "")).startswith(unfinished) for s in record["steps"])


def committed(root: Path, part: str, slug: str) -> Path | None:
    """A complete record of `part` under root/*/parts/ measured on the same kind of device (a
    GPU for a GPU, the CPU for the CPU) with rows of this schema, or None."""
    for path in sorted(root.glob(f"*/parts/{part}.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if complete(rec) and rec.get(SCHEMA) == SCHEMA_VERSION and \
                (rec.get("device") == "cpu") == (slug == "cpu"):
            return path
    return None


def run_part(part: str, ctx: study_plan.Context, env: dict, time_left, stamp: dict | None = None,
             whole_steps: bool = False, python: str = sys.executable) -> dict:
    """Every step of a part, each recorded; a failing step never stops the next. A priority
    part's steps stop at study_plan.PART_CAP x its budget; `whole_steps`: start a step only where
    its budget fits in the time left (the parts after the priority ones)."""
    folder = ctx.runs / part
    if folder.exists():  # a part measured again starts clean: no stale rows
        import shutil

        shutil.rmtree(folder)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    sizes = {k: ctx.size[k] for k in ("study", "resnet50", part)}  # what this part ran at
    record = {"part": part, "status": "running", "started": started, "size": sizes,
              **(stamp or {}), "steps": []}
    t0 = time.monotonic()
    cap = study_plan.PART_CAP * study_plan.BUDGETS[part] if part in study_plan.BUDGETS \
        else float("inf")
    atomic_write(folder / STATUS, json.dumps(record, indent=1) + "\n")
    try:
        steps = study_plan.BUILDERS[part](ctx)
    except Exception as e:  # a bad size: the part's row says so, the study goes on
        steps, record["error"] = [], f"{type(e).__name__}: {e}"
    for step in steps:
        left = min(time_left(), cap - (time.monotonic() - t0))
        if left < 30 or _STOP or (whole_steps and step.budget_s > left):
            why = "stopped by signal" if _STOP else "deadline"
            record["steps"].append({"name": step.name, "status": f"skipped ({why})",
                                    "budget_s": step.budget_s, "seconds": 0})
            continue
        timeout = min(ctx.size["study"]["timeout_factor"] * step.budget_s + 120, left)
        print(f"results: {part}/{step.name} (budget ~{step.budget_s:.0f} s, timeout "
              f"{timeout:.0f} s)", flush=True)
        record["steps"].append(run_step(step, folder / f"{step.name}.log", timeout, env,
                                        python))
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
    ap.add_argument("--profile", choices=tuple(study_plan.PROFILES),
                    help="sizes (default: gpu on cuda, cpu on cpu)")
    ap.add_argument("--parts", default=",".join(study_plan.PARTS),
                    help=f"comma list of {', '.join(study_plan.PARTS)}, report (default: all; the "
                         f"report is made after any of them)")
    ap.add_argument("--remeasure", default="", metavar="PARTS",
                    help="comma list of parts (or all) to measure again although complete "
                         "records of them are under --committed")
    ap.add_argument("--committed", type=Path, default=Path("docs/results"),
                    help="where complete part records (*/parts/<part>.json) are looked for")
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
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter that runs each step's command and the view's "
                         "memtrain-report (default: this one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    again = [p.strip() for p in a.remeasure.split(",") if p.strip()]
    again = list(study_plan.PARTS) if again == ["all"] else again
    wrong = [p for p in parts + again if p not in (*study_plan.PARTS, "report")]
    if wrong or not parts:
        print(f"results: unknown part {', '.join(wrong) or '(none)'}; valid: "
              f"{', '.join(study_plan.PARTS)}, report", file=sys.stderr)
        return 2
    profile = a.profile or ("gpu" if a.device == "cuda" else "cpu")
    try:
        size = study_plan.apply_sets(study_plan.PROFILES[profile], a.set)
    except ValueError as e:
        print(f"results: {e}", file=sys.stderr)
        return 2
    measuring = [p for p in study_plan.PARTS if p in parts]
    # the folder is named by the GPU; a measuring run checks that there is one
    slug = a.device if a.dry_run else \
        device_slug(a.device) if measuring or not a.name else None
    name = a.name or f"{datetime.date.today().isoformat()}_{slug}"
    out, runs = a.out or Path("docs/results") / name, a.runs or Path("runs/results") / name
    done = {p: committed(a.committed, p, slug or a.device) for p in measuring
            if p not in again}
    done = {p: path for p, path in done.items() if path}
    for p, path in done.items():
        print(f"results: {p}: complete in {path}; not measured again (--remeasure {p})",
              flush=True)
    measuring = [p for p in measuring if p not in done]
    if a.dry_run:
        ctx = study_plan.Context(a.device, runs, size, lambda where: "baseline" in parts)
        return dry_run(ctx, measuring)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # the GPU tests check compiled kernels
    else:  # one torch thread unless asked: on a shared CPU, OpenMP threads that wait for
        # each other made steps ~20x slower (resnet50 16 px b2: 1.2 s with one, 23-31 s with
        # two, at load ~13 on 2 cores); the CPU study measures memory, time is only a sign
        env.setdefault("OMP_NUM_THREADS", "1")
    ctx = study_plan.Context(a.device, runs, size, lambda where: find_none(runs, where))
    t0 = time.monotonic()
    reserve = 0 if a.no_report else VIEW_RESERVE_S
    time_left = (lambda: float("inf")) if a.deadline_s is None else \
        (lambda: a.deadline_s - reserve - (time.monotonic() - t0))
    print(f"results: {name}: parts {', '.join(measuring) or '(none)'}, sizes {profile}, "
          f"raw results in {runs}, view in {out}", flush=True)
    runs.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    stamp = {"device": slug or a.device, "commit": commit(), SCHEMA: SCHEMA_VERSION,
             "torch": _torch_version()}
    for part in measuring:
        if _STOP or time_left() < 30:  # not started: its earlier results, if any, stay
            print(f"results: {part}: not started ({'signal' if _STOP else 'deadline'})",
                  flush=True)
            continue
        record = run_part(part, ctx, env, time_left, stamp,
                          whole_steps=part not in study_plan.PRIORITY, python=a.python)
        atomic_write(out / "parts" / f"{part}.json", json.dumps(record, indent=1) + "\n")
        if a.archive:  # after every part: a call cut off later returns what it measured
            pack(a.archive, [runs, out])
    if _STOP:  # asked to stop: keep what was measured, leave the view to a later `report`
        print(f"results: stopped by signal {_STOP[0]}; raw results in {runs}", file=sys.stderr)
        return 128 + _STOP[0]
    if not a.no_report:
        view.make(runs, out, env, python=a.python)
        if a.archive:
            pack(a.archive, [runs, out])
    print(f"results: done in {time.monotonic() - t0:.0f} s -> "
          f"{runs if a.no_report else out / 'results.md'}")
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def dry_run(ctx: study_plan.Context, parts: list[str]) -> int:
    total = 0.0
    for part in parts:
        steps = study_plan.BUILDERS[part](ctx)
        budget = sum(s.budget_s for s in steps)
        total += budget
        cap = f" (part budget {study_plan.BUDGETS[part]} s)" if part in study_plan.BUDGETS else ""
        print(f"## {part}: ~{budget:.0f} s{cap}")
        for s in steps:
            print(f"  [{s.budget_s:.0f} s] python {' '.join(s.argv)}")
    print(f"total ~{total:.0f} s ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
