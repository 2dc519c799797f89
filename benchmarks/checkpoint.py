"""Checkpointing benchmark: memory and step time of every strategy against none, same process.

    python -m benchmarks.checkpoint                      # GPU: resnet50 224 px, batch search
    python -m benchmarks.checkpoint --device cpu --size 64 --batch 8 --out docs/results/x.md
    python -m benchmarks.checkpoint --frontier --device cpu --batch 184 --profile-batch 8
    python -m benchmarks.checkpoint ... --csv docs/results/rows/x.csv   # the rows, as CSV

`--frontier`: the planner alone (no training): one profile, then op- and block-granularity plans
at every budget on it, modelled peak, predicted overhead and solve time (MONeT's comparison).
With `--costs` (and `--csv`), any model (a language model's `--size` is its sequence length;
`--set` passes model options) and every op cost of `--costs`, the overhead also in FLOPs, as
rows for `make results-docs` (docs/results/transformer_checkpoint_cpu.md):

    python -m benchmarks.checkpoint --frontier --model gpt2_small --size 1024 \\
      --batch 1 --profile-batch 1 --device cpu --threads 1 --costs time,flops \\
      --budgets 0.25,0.3,0.35,0.4,0.5 --csv docs/results/rows/transformer_checkpoint_cpu.csv

On CUDA the batch is the largest power-of-two-then-bisected batch the baseline fits (unless
--batch), the peak is `max_memory_allocated` over the timed steps and times come from
synchronised host clocks. On the CPU the peak is the live-tensor tracker's (activation peak,
recomputation included) and torch.compile is left out (the tracker runs compiled code eagerly).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

import benchmarks as bench
from memtrain import api
from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.methods.checkpoint import CheckpointMethod

BUDGETS = (0.25, 0.3, 0.4, 0.5, 0.6, 0.8)
FRONTIER = (0.25, 0.3, 0.33, 0.4, 0.5, 0.6, 0.8)
COMPILE_BUDGETS = (0.2, 0.4, 0.6, 0.8, 1.0)


def points(device: torch.device) -> list[tuple[str, list[str]]]:
    """(label, method overrides) of every point of the sweep; none first."""
    pts = [("none", ["method=none"])]
    pts += [(f"{g} {f}", ["method=checkpoint", f"method.budget_fraction={f}",
                          f"method.granularity={g}"]) for g in ("op", "block") for f in BUDGETS]
    pts += [(s, ["method=checkpoint", f"method.strategy={s}"])
            for s in ("uniform", "sqrt", "selective")]
    if device.type == "cuda":
        pts += [(f"compile {f}", ["method=checkpoint", "method.strategy=compile",
                                  f"method.budget_fraction={f}"]) for f in COMPILE_BUDGETS]
    return pts


def run_point(model_name: str, size: int, batch: int, overrides: list[str],
              device: torch.device, steps: int, warmup: int) -> dict:
    """Peak and median step time of `steps` SGD steps after `warmup` (profiling included in
    neither)."""
    _, model, method = api.build([f"model={model_name}", f"dataset.image_size={size}",
                                  *overrides])
    model.to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    row: dict = {}
    if getattr(method, "strategy", None) in ("uniform", "sqrt", "budget"):
        row.update(method.prepare(model, x, y))
        if row.get("plan_budget_raised_to_bytes") is not None:  # below the smallest peak:
            # the run would plan at that peak (a warning); the table says infeasible, as before
            return {"error": f"infeasible; least peak {row['plan_budget_raised_to_bytes']}"}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cpu":
        tracker = measure.PeakTracker(model, opt, x, y)
        with tracker:
            step()
        row["act_peak"], row["peak"] = tracker.act_peak_bytes, tracker.peak_bytes
    measure.reset_cuda_peak(device)
    times = bench.timings(step, device, steps)
    if device.type == "cuda":
        row["peak"] = torch.cuda.max_memory_allocated(device)
    row["step_s"] = statistics.median(times)
    return row


def largest_batch(model_name: str, size: int, device: torch.device, start: int = 32) -> int:
    """The largest batch whose baseline step fits on the GPU (doubling, then bisection)."""
    def fits(b: int) -> bool:
        try:
            run_point(model_name, size, b, ["method=none"], device, steps=1, warmup=1)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def table(rows: list[dict], device: torch.device) -> str:
    base = rows[0]
    peak_name = "peak alloc" if device.type == "cuda" else "act peak"
    key = "peak" if device.type == "cuda" else "act_peak"
    out = [f"| point | {peak_name} MiB | x none | step ms | x none | plan peak MiB | "
           f"plan overhead |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | {r['error']} | | | | | |")
            continue
        plan = (f"{r['plan_peak_bytes'] / 2**20:.1f} | {100 * r['plan_overhead']:+.1f}%"
                if "plan_peak_bytes" in r else "- | -")
        out.append(f"| {r['label']} | {r[key] / 2**20:.1f} | {r[key] / base[key]:.3f} | "
                   f"{1e3 * r['step_s']:.1f} | {r['step_s'] / base['step_s']:.3f} | {plan} |")
    return "\n".join(out)


def language_model(model_name: str, extra: Sequence[str] = ()) -> bool:
    """Does the model read token sequences (its conf picks token data)?"""
    cfg, _ = api.compose([f"model={model_name}", *(o for o in extra if o.startswith("model."))])
    return cfg.dataset._target_.startswith("memtrain.data.tokens")


def profiled(model_name: str, size: int, batch: int, profile_batch: int, device: torch.device,
             extra: Sequence[str] = (), flops: bool = True
             ) -> tuple[CheckpointMethod, float, float]:
    """(method, profile seconds, step FLOPs): `model_name` built with the `extra` overrides, a
    checkpoint dry run profiled on `profile_batch` samples of a random batch of `batch` (an
    image model's at `size` px, a language model's of `size` tokens) and scaled to the batch;
    the step's FLOPs (torch.utils.flop_counter: forward + backward of the plain model),
    counted on the profiled slice and scaled alike (0 without `flops`: no extra step)."""
    import time

    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.run.estimate import random_batch

    lm = language_model(model_name, extra)
    data, model, method = api.build([
        f"model={model_name}", f"dataset.{'seq_len' if lm else 'image_size'}={size}",
        *(["dataset.train_size=2", "dataset.test_size=2"] if lm else []), "method=checkpoint",
        "method.dry_run=true", f"method.profile_batch={profile_batch}", *extra])
    model.to(device).train()
    precision = [o.split("=", 1)[1] for o in extra if o.startswith("trainer.precision=")]
    torch.manual_seed(0)
    x, y = random_batch(batch, data.input_shape, data.num_classes, device, data.task,
                        (precision or ["fp32"])[-1])
    t0 = time.perf_counter()
    method.prepare(model, x, y)
    seconds = time.perf_counter() - t0
    if not flops:
        return method, seconds, 0.0
    scale, xs, ys = method._profile_slice(x, y)
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(xs).float(), ys).backward()
    model.zero_grad(set_to_none=True)
    return method, seconds, counter.get_total_flops() * scale


def frontier_rows(method: CheckpointMethod, step_flops: float, device: torch.device,
                  budgets: Sequence[float] = FRONTIER,
                  costs: Sequence[str] = ("time",)) -> list[dict]:
    """At every cost (`ops.price`) and budget, the op- and block-granularity plans on the
    method's one profile: modelled peak / the baseline's, predicted overhead (recomputed
    forward time / the baseline's step time: the profile's clock), the same in FLOPs
    (recomputed forward FLOPs / the step's), solve time, and what FLOP-carrying ops the op
    plan recomputes."""
    import memtrain.methods.checkpoint.ops as opplan
    import memtrain.methods.checkpoint.plan as planner

    p, ops = method.profile, method.ops
    base = p.baseline_peak
    rows = []
    for cost in costs:
        opplan.price(ops, cost, device.type)
        for f in budgets:
            row: dict = {"cost": cost, "budget": f}
            for by_op, g in ((True, "op"), (False, "block")):
                try:
                    pl = opplan.plan_budget(p, ops, f * base, ops=by_op)
                except planner.Infeasible as e:
                    row[f"{g}_peak"] = f"infeasible (least {e.min_peak / base:.3f})"
                    continue
                keep = set(pl.extra.get("keep", []))
                row.update({f"{g}_peak": round(pl.peak / base, 3),
                            f"{g}_overhead": round(pl.overhead, 4),
                            f"{g}_flops_overhead": round(
                                opplan.recompute_flops(ops, pl.groups, keep) / step_flops, 4),
                            f"{g}_solve_s": round(pl.extra["solve_s"], 2)})
                if by_op:
                    row["op_recomputes"] = opplan.recomputed_matmuls(ops, pl.groups, keep)
            for k in ("overhead", "flops_overhead"):
                if row.get(f"block_{k}"):
                    row[f"op_vs_block_{k}"] = round(row[f"op_{k}"] / row[f"block_{k}"], 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def budget_rows(model_name: str, size: int, batch: int, profile_batch: int,
                device: torch.device) -> tuple[dict, list[dict]]:
    """Op- and block-granularity plans at every budget of FRONTIER on one profile (the
    profile's own clock): the profile's figures and one row per budget ("infeasible" with the
    least modelled peak where a plan is)."""
    import memtrain.methods.checkpoint.ops as opplan
    import memtrain.methods.checkpoint.plan as planner

    method, seconds, _ = profiled(model_name, size, batch, profile_batch, device, flops=False)
    p, ops = method.profile, method.ops
    head = {"model": model_name, "size": size, "batch": batch,
            "profile_s": seconds, "profile_samples": min(batch, profile_batch),
            "segments": p.n, "ops": sum(map(len, ops.ops)), "keepable": len(ops.keys()),
            "baseline_act_peak_bytes": p.baseline_peak, "baseline_step_s": p.step_time}
    least = [_least(p, o, by_op) / p.baseline_peak
             for o, by_op in ((ops, True), (opplan.OpProfile(ops.ops), True), (ops, False))]
    head |= {"least_op": least[0], "least_op_no_compaction": least[1], "least_block": least[2],
             "compaction_offered": "; ".join(f"{p.names[c.seg]} -{c.saves / 2**20:.0f} MiB "
                                             f"({c.what})" for c in ops.compact) or "none"}
    rows = []
    for f in FRONTIER:
        row = {"budget": f}
        for by_op, key in ((True, "op"), (False, "block")):
            try:
                pl = opplan.plan_budget(p, ops, f * p.baseline_peak, ops=by_op)
            except planner.Infeasible as e:
                row[f"{key}_infeasible_least"] = e.min_peak / p.baseline_peak
                continue
            row |= {f"{key}_peak": pl.peak / p.baseline_peak, f"{key}_overhead": pl.overhead,
                    f"{key}_solve_s": pl.extra["solve_s"]}
            if by_op:  # the segments compacted (checkpoint/compaction.py: lossless masks, offsets)
                row["op_compacts"] = ", ".join(p.names[i] for i in pl.extra["compact"]) or "-"
        rows.append(row | head)
        print(row, flush=True)
    return head, rows


def frontier_table(rows: list[dict]) -> str:
    """The frontier's markdown table (rows as measured, or read back from --csv)."""
    out = ["| budget | op peak | op overhead | op solve s | op compacts | block peak | "
           "block overhead | block solve s | op / block overhead |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("op", "block"):
            if f"{key}_infeasible_least" in r:
                cells += [f"infeasible (least {r[f'{key}_infeasible_least']:.3f})", "-", "-"]
                cells += ["-"] * (key == "op")
                continue
            cells += [f"{r[f'{key}_peak']:.3f}", f"+{100 * r[f'{key}_overhead']:.1f}%",
                      f"{r[f'{key}_solve_s']:.1f}"]
            if key == "op":
                cells.append(r.get("op_compacts", "-"))
        both = "op_overhead" in r and "block_overhead" in r and r["block_overhead"] > 0
        ratio = f"{r['op_overhead'] / r['block_overhead']:.2f}" if both else "-"
        out.append(f"| {r['budget']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out)


def frontier_summary(head: dict) -> tuple[str, str]:
    """The lines above and below the frontier's table, from the profile's figures."""
    above = (f"profiled in {head['profile_s']:.0f} s on {head['profile_samples']} samples, "
             f"scaled to {head['batch']}; {head['segments']} segments, {head['ops']} ops, "
             f"{head['keepable']} keepable; baseline activation peak "
             f"{head['baseline_act_peak_bytes'] / 2**30:.2f} GiB, step "
             f"{head['baseline_step_s']:.1f} s")
    below = (f"least modelled peak: op {head['least_op']:.3f}x (without compaction "
             f"{head['least_op_no_compaction']:.3f}x), block {head['least_block']:.3f}x; "
             f"compaction choices: {head['compaction_offered']}")
    return above, below


def frontier(model_name: str, size: int, batch: int, profile_batch: int,
             device: torch.device) -> str:
    """Op- and block-granularity plans at every budget of FRONTIER on one profile."""
    head, rows = budget_rows(model_name, size, batch, profile_batch, device)
    above, below = frontier_summary(head)
    return f"{above}\n\n{frontier_table(rows)}\n\n{below}"


def layer_ops(method: CheckpointMethod, seg: int) -> list[dict]:
    """One segment's profiled ops that make a fresh output (views and in-place writes make
    none), in forward order: output MiB, forward ms (calibrated to the segment's measured
    forward), GFLOP, and the share of the segment's forward time."""
    import memtrain.methods.checkpoint.ops as opplan

    ops = method.ops.ops[seg]
    total = sum(o.time for o in ops)
    rows = [{"op": j, "name": opplan.short(o.name), "out_mib": round(o.nbytes / 2**20, 2),
             "fwd_ms": round(o.time * 1e3, 2), "gflop": round(o.flops / 1e9, 3),
             "time_share": round(o.time / total, 3)}
            for j, o in enumerate(ops) if o.nbytes > 0]
    rest = total - sum(o.time for o in ops if o.nbytes > 0)
    rows.append({"op": "-", "name": "views and in-place (no fresh output)", "out_mib": 0,
                 "fwd_ms": round(rest * 1e3, 2), "gflop": 0, "time_share": round(rest / total, 3)})
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    import csv
    import io

    from memtrain.record import atomic_write

    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(Path(path), buf.getvalue())
    print(f"wrote {path}")


def _least(p, ops, by_op: bool) -> int:
    import memtrain.methods.checkpoint.ops as opplan
    import memtrain.methods.checkpoint.plan as planner

    try:
        opplan.plan_budget(p, ops, 1, ops=by_op)
    except planner.Infeasible as e:
        return e.min_peak
    return 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=None, help="default: largest that fits (GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--frontier", action="store_true", help="the planner's frontier only")
    ap.add_argument("--profile-batch", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                    help="--frontier: a config override of the model (model.attention=math)")
    ap.add_argument("--costs", default=None,
                    help="--frontier: plan on these op costs (ops.price: time, roofline, "
                         "flops; comma-separated) and write their rows to --csv (and the "
                         "profiled layer's ops beside it, *_ops.csv); without it, the frontier "
                         "table on the profile's clock (its rows to --csv, with provenance)")
    ap.add_argument("--budgets", default=",".join(map(str, FRONTIER)))
    ap.add_argument("--csv", default=None, help="write the rows here (CSV)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.frontier and args.costs:
        if not args.csv:
            ap.error("--costs writes rows: name them with --csv")
        batch = args.batch or 184
        method, seconds, step_flops = profiled(args.model, args.size, batch, args.profile_batch,
                                               device, args.set)
        rows = frontier_rows(method, step_flops, device,
                             [float(b) for b in args.budgets.split(",")],
                             args.costs.split(","))
        p = method.profile
        for r in rows:  # the profile's figures on every row
            r.update(profile_s=round(seconds, 1), baseline_peak_mib=round(
                p.baseline_peak / 2**20, 1), step_s=round(p.step_time, 3),
                step_gflop=round(step_flops / 1e9, 2))
        write_csv(args.csv, rows)
        write_csv(str(args.csv).removesuffix(".csv") + "_ops.csv", layer_ops(method, 1))
        return
    if args.frontier:
        batch = args.batch or 184
        head, rows = budget_rows(args.model, args.size, batch, args.profile_batch, device)
        above, below = frontier_summary(head)
        text = (f"# checkpoint planner frontier: {args.model}, {args.size} px, batch {batch}\n\n"
                f"Device: {bench.device_line(device)}\n\n{above}\n\n{frontier_table(rows)}"
                f"\n\n{below}\n")
        bench.publish(text, args.out)
        bench.write_rows(rows, args.csv, device,
                         bench.command("benchmarks.checkpoint", argv), append=True)
        return
    batch = args.batch or (largest_batch(args.model, args.size, device)
                           if device.type == "cuda" else 8)
    rows = []
    for label, ov in points(device):
        r = run_point(args.model, args.size, batch, ov, device, args.steps, args.warmup)
        rows.append({"label": label, "model": args.model, "size": args.size, "batch": batch,
                     **r})
        print(f"{label}: {r}", flush=True)
    text = (f"# checkpoint benchmark: {args.model}, {args.size} px, batch {batch}\n\n"
            f"Device: {bench.device_line(device)}; {args.steps} timed steps after {args.warmup} "
            f"warm-up, median.\n\n{table(rows, device)}\n")
    bench.publish(text, args.out)
    bench.write_rows(rows, args.csv, device, bench.command("benchmarks.checkpoint", argv),
                     append=True)


if __name__ == "__main__":
    main()
