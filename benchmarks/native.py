"""The budget planner against the model's own checkpointing, side by side in one process.

Per model, three copies from the same initial weights on one fixed random batch: none,
`method.strategy=native` (timm's `set_grad_checkpointing()`, transformers'
`gradient_checkpointing_enable()`) and `method.strategy=budget` with `method.budget_bytes` set to
native's measured activation peak: the plan asked to hold at most what native holds. Each copy's
peaks come from one tracked step (`measure.PeakTracker`): the activation peak (what the planner
budgets: activations, recomputed ones included) and the activations + backward temporaries
peak (the complete tensor memory of the step's activations). The budget is native's activation
peak, not its act + temp. peak, because the activation peak is the quantity the planner models
and is held to; the act + temp. peaks are reported beside it.

The planner holds its budget on its model of the peak, which can miss the measured one. Where
the plan's tracked step measures over native's peak, it is planned again with the budget
lowered by the excess (as memtrain holds a stack's plan to a measured step), at most
`--replans` times; where an op plan still measures over, the block plan (whole groups) is
tried the same way and the one that measures less is timed. The row keeps the first plan's
measured peak, the re-plans, the granularity timed, the budget it was asked for, and says so
where it still measures over: a loss on memory, reported as one.

Step times are interleaved: every round runs `--steps` timed steps of each copy in turn (the
order reversed every other round, so drift of a shared machine hits all alike) and keeps each
copy's median; the ratio planner / native is taken per round, and the row reports its median
over the rounds with its min and max. The verdict: `planner faster` when every round's ratio is
below 1, `planner slower` when every one is above 1, else `equal within spread`.

    python -m benchmarks.native                         # the three models, on the CPU
    python -m benchmarks.native --only convnext_atto --rounds 3
    python -m benchmarks.native --csv docs/results/rows/native_cpu.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import benchmarks as bench
from memtrain import api
from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.run.estimate import random_batch


@dataclass(frozen=True)
class Case:
    """One model: its label, the overrides that build it and its data, and the batch."""
    label: str
    overrides: tuple[str, ...]
    batch: int

    def describe(self) -> str:
        return " ".join(self.overrides)


# CPU sizes each model accepts; the ViT is timm's at 64 px (timm takes img_size for ViTs)
CPU = torch.device("cpu")
CASES = {
    "convnext_atto": Case("convnext_atto", ("model=timm", "model.name=convnext_atto",
                                            "dataset=synthetic", "dataset.image_size=64"), 8),
    "vit_small": Case("vit_small", ("model=timm", "model.name=vit_small_patch16_224",
                                    "dataset=synthetic", "dataset.image_size=64"), 8),
    "llama": Case("llama", ("model=hf", "model.name=llama", "model.config.num_hidden_layers=2",
                            "model.config.hidden_size=128", "dataset.seq_len=128",
                            "dataset.train_size=4", "dataset.test_size=2"), 4),
}
VARIANTS = ("none", "native", "planner")


class Runner:
    """One copy of the model with its method applied, an SGD optimizer and one step."""

    def __init__(self, case: Case, method: Sequence[str], x: torch.Tensor, y: torch.Tensor):
        torch.manual_seed(0)  # every copy starts from the same weights
        _, self.model, self.method = api.build([*case.overrides, *method])
        self.model.train()
        self.x, self.y = x, y
        self.columns: dict = {}
        if hasattr(self.method, "prepare"):
            self.columns = self.method.prepare(self.model, x, y) or {}
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self) -> None:
        """One training step as memtrain's loop runs it: the output is kept until the update
        (the planner's `Profile.output`), so native's peak and the plan's count the same."""
        out = self.model(self.x)
        cross_entropy(out.float(), self.y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        del out

    def peaks(self) -> tuple[int, int]:
        """(activation peak, activations + backward temporaries peak) of one tracked step."""
        tracker = measure.PeakTracker(self.model, self.opt, self.x, self.y)
        with tracker:
            self.step()
        return tracker.act_peak_bytes, tracker.act_temp_peak_bytes


def interleaved(steps: dict[str, Callable[[], None]], rounds: int, reps: int,
                device: torch.device) -> dict[str, list[float]]:
    """Each name's median step time per round: `reps` timed steps of each in turn per round,
    the order reversed every other round."""
    names = list(steps)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            out[n].append(statistics.median(bench.timings(steps[n], device, reps)))
    return out


def verdict(ratios: Sequence[float]) -> str:
    """planner / native per round -> which is faster, or equal within the rounds' spread."""
    if max(ratios) < 1:
        return "planner faster"
    if min(ratios) > 1:
        return "planner slower"
    return "equal within spread"


def plan_within(case: Case, budget: int, x: torch.Tensor, y: torch.Tensor, warmup: int,
                granularity: str = "op", replans: int = 3) -> tuple[Runner, dict]:
    """The budget plan whose measured activation peak holds `budget`: planned at `budget`
    bytes; while a tracked step measures over it, planned again with the budget lowered by the
    excess (as memtrain holds a stack's plan to a measured step), at most `replans` times, or
    until the planner raises the budget to its least modelled peak. Returns the last plan's
    runner and what it took: the first plan's measured peak, the re-plans, the budget the last
    plan was asked for, the least modelled peak it was raised to (or None)."""
    target, first, tries = budget, None, 0
    while True:
        plan = Runner(case, ["method=checkpoint", "method.strategy=budget",
                             f"method.granularity={granularity}",
                             f"method.budget_bytes={target}"], x, y)
        for _ in range(warmup):
            plan.step()
        peaks = plan.peaks()
        first = peaks[0] if first is None else first
        raised = plan.columns.get("plan_budget_raised_to_bytes")
        if peaks[0] <= budget or raised is not None or tries == replans:
            return plan, {"peaks": peaks, "first_act_peak": first, "replans": tries,
                          "asked": target, "raised": raised}
        target -= peaks[0] - budget
        tries += 1
        del plan


def best_plan(case: Case, budget: int, x: torch.Tensor, y: torch.Tensor, warmup: int,
              granularity: str = "op", replans: int = 3) -> tuple[Runner, dict]:
    """`plan_within` at `granularity`; where that plan still measures over the budget and it
    planned ops, the block plan too (whole groups: what the planner offers next), and of the two
    the one that measures the lower activation peak (the op plan on a tie)."""
    plan, got = plan_within(case, budget, x, y, warmup, granularity, replans)
    got["tried"] = granularity
    if got["peaks"][0] <= budget or granularity == "block":
        return plan, got
    block, got_block = plan_within(case, budget, x, y, warmup, "block", replans)
    got_block["tried"] = f"{granularity}, block"
    got_block["first_act_peak"] = got["first_act_peak"]
    got_block["replans"] += got["replans"]
    if got_block["peaks"][0] < got["peaks"][0]:
        return block, got_block
    got["tried"] = got_block["tried"]
    return plan, got


def measure_case(case: Case, rounds: int, reps: int, warmup: int,
                 device: torch.device = CPU, granularity: str = "op",
                 replans: int = 3) -> dict:
    """One model's row: peaks of none, native and the plan held to native's activation peak
    (`plan_within`), and their interleaved step times."""
    t0 = time.perf_counter()
    data, _, _ = api.build(list(case.overrides))
    torch.manual_seed(0)
    x, y = random_batch(case.batch, data.input_shape, data.num_classes, device, data.task)
    none = Runner(case, ["method=none"], x, y)
    native = Runner(case, ["method=checkpoint", "method.strategy=native"], x, y)
    for r in (none, native):
        for _ in range(warmup):
            r.step()
    peaks = {"none": none.peaks(), "native": native.peaks()}
    budget = peaks["native"][0]
    plan, got = best_plan(case, budget, x, y, warmup, granularity, replans)
    peaks["planner"] = got["peaks"]
    runners = {"none": none, "native": native, "planner": plan}
    times = interleaved({n: r.step for n, r in runners.items()}, rounds, reps, device)
    ratios = [p / n for p, n in zip(times["planner"], times["native"], strict=True)]
    cols = plan.columns
    over = peaks["planner"][0] - budget
    if over > 0 and got["raised"] is not None:
        note = (f"{over} bytes over: modelled {cols.get('plan_peak_bytes')}, the least the "
                f"{cols.get('plan_granularity')} plan models, measures more")
    elif over > 0:
        note = (f"{over} bytes over after {got['replans']} re-plans (modelled "
                f"{cols.get('plan_peak_bytes')})")
    else:
        note = ""
    row = {"model": case.label, "setting": case.describe(), "batch": case.batch,
           "budget_bytes": budget}
    for n in VARIANTS:
        row[f"{n}_act_peak_bytes"], row[f"{n}_act_temp_peak_bytes"] = peaks[n]
    for n in VARIANTS:
        row[f"{n}_step_s"] = statistics.median(times[n])
    row |= {"planner_vs_native": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "verdict": verdict(ratios),
            "within_budget": over <= 0, "plan_note": note,
            "first_plan_act_peak_bytes": got["first_act_peak"], "replans": got["replans"],
            "plan_asked_bytes": got["asked"],
            "plan_peak_bytes": cols.get("plan_peak_bytes"),
            "plan_granularity": cols.get("plan_granularity"),
            "granularities_tried": got["tried"],
            "plan_groups": cols.get("plan_groups"),
            "rounds": rounds, "steps": reps, "warmup": warmup,
            "threads": torch.get_num_threads(),
            "wall_s": round(time.perf_counter() - t0, 1)}
    return row


COLUMNS = {  # the comparison: column -> heading
    "model": "model", "batch": "batch",
    "none_act_peak_bytes": "none act. MiB", "native_act_peak_bytes": "native act. MiB",
    "planner_act_peak_bytes": "planner act. MiB",
    "none_act_temp_peak_bytes": "none act.+temp. MiB",
    "native_act_temp_peak_bytes": "native act.+temp. MiB",
    "planner_act_temp_peak_bytes": "planner act.+temp. MiB",
    "none_step_s": "none ms", "native_step_s": "native ms", "planner_step_s": "planner ms",
    "planner_vs_native": "planner / native time, median (min-max)", "verdict": "time verdict",
    "within_budget": "planner act. <= native's",
}
PLAN_COLUMNS = {  # how the timed plan was found: column -> heading
    "model": "model", "granularities_tried": "granularities tried",
    "plan_granularity": "timed plan", "replans": "re-plans",
    "first_plan_act_peak_bytes": "first plan act. / native's", "plan_asked_bytes": "asked MiB",
    "plan_peak_bytes": "modelled MiB", "plan_groups": "recomputed groups",
    "plan_note": "over native's peak: why",
}


def _cell(r: dict, k: str) -> str:
    v = r.get(k, "")
    if k == "first_plan_act_peak_bytes":
        return f"{v / r['budget_bytes']:.3f}"
    if k.endswith("_bytes"):
        return f"{v / 2**20:.2f}"
    if k.endswith("_step_s"):
        return f"{v * 1e3:.1f}"
    if k == "planner_vs_native":
        return f"{v:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
    if k == "within_budget":
        over = r["planner_act_peak_bytes"] - r["budget_bytes"]
        return "yes" if over <= 0 else f"no (+{over / 2**10:.1f} KiB)"
    return str(v) if v != "" else "-"


def _markdown(rows: list[dict], cols: dict[str, str]) -> list[str]:
    return ["| " + " | ".join(cols.values()) + " |", "|" + " --- |" * len(cols),
            *("| " + " | ".join(_cell(r, k) for k in cols) + " |" for r in rows)]


def table(rows: list[dict]) -> str:
    """The markdown tables of result rows (as measured, or read back from --csv): the
    comparison, then how each timed plan was found."""
    return "\n".join([*_markdown(rows, COLUMNS), "", *_markdown(rows, PLAN_COLUMNS)]) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CASES),
                    help=f"comma-separated models of {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per copy and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per copy first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--granularity", choices=("op", "block"), default="op",
                    help="the plan's method.granularity")
    ap.add_argument("--replans", type=int, default=3,
                    help="re-plans at most while the plan measures over native's peak")
    ap.add_argument("--csv", default=None, help="write the rows here (CSV)")
    args = ap.parse_args(argv)
    names = args.only.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--only: unknown model {unknown[0]!r}; choose from {', '.join(CASES)}")
    torch.set_num_threads(args.threads)
    device = CPU
    rows = []
    for n in names:
        row = measure_case(CASES[n], args.rounds, args.steps, args.warmup, device,
                           args.granularity, args.replans)
        print(row, flush=True)
        rows.append(row)
    print(f"Device: {bench.device_line(device)}\n\n{table(rows)}")
    if args.csv:
        from benchmarks.checkpoint import write_csv

        write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
