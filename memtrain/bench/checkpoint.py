"""Checkpointing benchmark: memory and step time of every strategy against none, same process.

    python -m memtrain.bench.checkpoint                      # GPU: resnet50 224 px, batch search
    python -m memtrain.bench.checkpoint --device cpu --size 64 --batch 8 --out docs/results/x.md
    python -m memtrain.bench.checkpoint --frontier --device cpu --batch 184 --profile-batch 8

`--frontier`: the planner alone (no training): one profile, then op- and block-granularity plans
at every budget on it, modelled peak, predicted overhead and solve time (MONeT's comparison).

On CUDA the batch is the largest power-of-two-then-bisected batch the baseline fits (unless
--batch), the peak is `max_memory_allocated` over the timed steps and times come from
synchronised host clocks. On the CPU the peak is the live-tensor tracker's (activation peak,
recomputation included) and torch.compile is left out (the tracker runs compiled code eagerly).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from memtrain import api, bench, measure

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


def frontier(model_name: str, size: int, batch: int, profile_batch: int,
             device: torch.device) -> str:
    """Op- and block-granularity plans at every budget of FRONTIER on one profile."""
    import time

    import memtrain.methods.checkpoint.ops as opplan
    import memtrain.methods.checkpoint.plan as planner

    _, model, method = api.build([f"model={model_name}", f"dataset.image_size={size}",
                                  "method=checkpoint", "method.dry_run=true",
                                  f"method.profile_batch={profile_batch}"])
    model.to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    t0 = time.perf_counter()
    method.prepare(model, x, y)
    p, ops = method.profile, method.ops
    out = [f"profiled in {time.perf_counter() - t0:.0f} s on {min(batch, profile_batch)} "
           f"samples, scaled to {batch}; {p.n} segments, {sum(map(len, ops.ops))} ops, "
           f"{len(ops.keys())} keepable; baseline activation peak {p.baseline_peak / 2**30:.2f} "
           f"GiB, step {p.step_time:.1f} s", "",
           "| budget | op peak | op overhead | op solve s | op compacts | block peak | "
           "block overhead | block solve s | op / block overhead |",
           "|---|---|---|---|---|---|---|---|---|"]
    for f in FRONTIER:
        cells, over = [], []
        for by_op in (True, False):
            try:
                pl = opplan.plan_budget(p, ops, f * p.baseline_peak, ops=by_op)
            except planner.Infeasible as e:
                cells += [f"infeasible (least {e.min_peak / p.baseline_peak:.3f})", "-", "-"]
                cells += ["-"] * by_op
                continue
            over.append(pl.overhead)
            cells += [f"{pl.peak / p.baseline_peak:.3f}", f"+{100 * pl.overhead:.1f}%",
                      f"{pl.extra['solve_s']:.1f}"]
            if by_op:  # the segments compacted (checkpoint/compact.py: lossless masks, offsets)
                cells.append(", ".join(p.names[i] for i in pl.extra["compact"]) or "-")
        ratio = f"{over[0] / over[1]:.2f}" if len(over) == 2 and over[1] > 0 else "-"
        out.append(f"| {f} | " + " | ".join(cells) + f" | {ratio} |")
        print(out[-1], flush=True)
    least = [_least(p, o, by_op) / p.baseline_peak
             for o, by_op in ((ops, True), (opplan.OpProfile(ops.ops), True), (ops, False))]
    offered = ", ".join(f"{p.names[c.seg]} -{c.saves / 2**20:.0f} MiB ({c.what})"
                        for c in ops.compact) or "none"
    out += ["", f"least modelled peak: op {least[0]:.3f}x (without compaction {least[1]:.3f}x), "
                f"block {least[2]:.3f}x; compaction choices: {offered}"]
    return "\n".join(out)


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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.frontier:
        batch = args.batch or 184
        text = (f"# checkpoint planner frontier: {args.model}, {args.size} px, batch {batch}\n\n"
                f"Device: {bench.device_line(device)}\n\n"
                f"{frontier(args.model, args.size, batch, args.profile_batch, device)}\n")
        bench.publish(text, args.out)
        return
    batch = args.batch or (largest_batch(args.model, args.size, device)
                           if device.type == "cuda" else 8)
    rows = []
    for label, ov in points(device):
        r = run_point(args.model, args.size, batch, ov, device, args.steps, args.warmup)
        rows.append({"label": label, **r})
        print(f"{label}: {r}", flush=True)
    text = (f"# checkpoint benchmark: {args.model}, {args.size} px, batch {batch}\n\n"
            f"Device: {bench.device_line(device)}; {args.steps} timed steps after {args.warmup} "
            f"warm-up, median.\n\n{table(rows, device)}\n")
    bench.publish(text, args.out)


if __name__ == "__main__":
    main()
