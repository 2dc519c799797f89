"""Will it fit, and at what cost: every method (and stack) for one model, batch and card.

    memtrain-willfit model=resnet50 dataset.image_size=224 trainer.batch_size=256 card=rtx4090

For each setting (a method at its defaults and at the settings that change its memory), the
GPU-free estimate (`estimate.estimate_peak`, fake tensors) of the step's peak and its
breakdown; whether it fits the card with find_max_batch's margin (peak + CUDA context <=
(1 - `trainer.max_batch_headroom`) x `trainer.gpu_memory_gb`); the largest batch that fits;
the predicted step-time overhead with its source; and whether the gradients are exact.

The largest batch: for a fixed plan the peak is affine in the batch in pieces (weights,
gradients and optimizer state do not grow with it, activations do; the peak moves from the
update to backward as the batch grows), so the line through two estimates gives a first
answer and secant steps through full estimates near it settle on the right piece. The answer
is then checked with full estimates: it fits at B and not at B + 1; a bisection over full
estimates where the steps do not settle (a plan that changes with the batch).

What the estimate leaves out (said in the output): the CUDA caching allocator's rounding and
fragmentation, cuDNN/cuBLAS workspaces; the CUDA context is counted as find_max_batch counts
it (`trainer.cuda_context_gb`, else `capacity.ASSUMED_CONTEXT_BYTES`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memtrain.config import loader
from memtrain.errors import ConfigError
from memtrain.run import capacity, estimate

log = logging.getLogger("memtrain")

GiB = capacity.GiB
COMMAND = "memtrain-willfit"

# Card presets: the memory each card is sold with, in GiB (2**30 bytes). The memory a process can
# use is a little less (ECC, the driver's reservations): set trainer.gpu_memory_gb to what
# `nvidia-smi` reports as total for your card to be exact.
CARDS = {
    "rtx3090": 24.0, "rtx4090": 24.0, "l4": 24.0, "a10": 24.0, "v100_16": 16.0,
    "v100_32": 32.0, "a100_40": 40.0, "a100_80": 80.0, "h100_80": 80.0, "h200": 141.0,
}


@dataclass(frozen=True)
class Setting:
    """One row of the table: a method (or stack) and the overrides that set it."""

    method: str
    params: tuple[str, ...] = ()  # `method.key=value` overrides beyond the method's defaults
    ranks: int = 1  # more than one: one rank of an fsdp run over this many

    @property
    def label(self) -> str:
        return " ".join([self.method, *(p.removeprefix("method.") for p in self.params),
                         *([f"fsdp x{self.ranks}"] if self.ranks > 1 else [])])

    def overrides(self) -> list[str]:
        return [f"method={self.method}", *self.params,
                *([f"trainer.strategy=fsdp trainer.world_size={self.ranks}"]
                  if self.ranks > 1 else [])]


# Every method at its defaults and at the settings that change its memory most: checkpoint's
# budget down to the least feasible (a budget below it is raised to it: the plan's own floor),
# quantize's bits, pool's window, prune's sparsity, offload's prefetch (one saved tensor more on
# the card during backward); then the stack. The estimate's device stands in for the card, so
# offload's host copies are none of its memory (methods/offload.py `_host_like`).
SETTINGS = (
    Setting("none"),
    Setting("checkpoint"),
    Setting("checkpoint", ("method.budget_fraction=0.25",)),
    Setting("checkpoint", ("method.budget_fraction=0.1",)),
    Setting("checkpoint", ("method.budget_fraction=0.01",)),
    Setting("quantize", ("method.bits=8",)),
    Setting("quantize"),
    Setting("quantize", ("method.bits=2",)),
    Setting("pool"),
    Setting("pool", ("method.kernel_size=4",)),
    Setting("prune"),
    Setting("prune", ("method.sparsity=0.75",)),
    Setting("synthetic"),
    Setting("offload"),
    Setting("offload", ("method.prefetch=true",)),
    Setting("checkpoint+quantize"),
)
FAMILIES = tuple(dict.fromkeys(s.method for s in SETTINGS))
BATCH_LIMIT = 2**24  # the largest batch the search reports ("at least" beyond it)
LEAVES_OUT = ("the CUDA caching allocator's rounding and fragmentation, cuDNN/cuBLAS "
              "workspaces (keep the headroom for them)")
# where a method's accuracy evidence is documented (its page's accuracy section and rows)
EVIDENCE = {m: f"docs/methods/{m}.md" for m in ("pool", "prune", "quantize", "synthetic")}
EVIDENCE["checkpoint+quantize"] = "docs/stacks.md"


@dataclass
class Answer:
    """What the command found: the rows (one per setting), the one-line answer, the card."""

    rows: list[dict[str, Any]]
    answer: str
    card: dict[str, Any]
    leaves_out: str = LEAVES_OUT
    out_dir: str | None = None
    wall_s: float = 0.0
    files: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- input


def parse(args: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split the command's own options (card=, methods=, settings=, out=) from memtrain's
    overrides; a one-line ConfigError for what it cannot take."""
    overrides, own = [], {"card": None, "methods": None, "out": None, "settings": "all",
                          "ranks": None}
    for a in args:
        key, eq, value = a.partition("=")
        if key in own:
            if not eq or not value:
                raise ConfigError(f"{key}= needs a value")
            own[key] = value
        elif key.lstrip("+~").split(".")[0] == "method" or key.lstrip("+~").startswith("method@"):
            raise ConfigError(f"{a}: {COMMAND} tries every method itself; narrow them with "
                              f"methods={','.join(FAMILIES[:3])} (choices: "
                              f"{', '.join(FAMILIES)})")
        elif a.startswith("-"):
            raise ConfigError(f"{a}: unknown flag ({COMMAND} takes overrides key=value, "
                              f"card=NAME, methods=a,b, settings=all|defaults, ranks=N, "
                              f"out=DIR; "
                              f"--help)")
        else:
            overrides.append(a)
    if own["card"] is not None:
        if own["card"] not in CARDS:
            raise ConfigError(f"card must be one of {', '.join(CARDS)}, got {own['card']!r} "
                              f"(or set trainer.gpu_memory_gb in GiB)")
        if any(o.split("=")[0].lstrip("+") == "trainer.gpu_memory_gb" for o in overrides):
            raise ConfigError("card= and trainer.gpu_memory_gb both set the card's memory; "
                              "give one")
        overrides.append(f"trainer.gpu_memory_gb={CARDS[own['card']]}")
    if own["ranks"] is not None:
        if not own["ranks"].isdigit() or int(own["ranks"]) < 2:
            raise ConfigError(f"ranks must be a whole number >= 2 (fsdp over that many), got "
                              f"{own['ranks']!r}")
        own["ranks"] = int(own["ranks"])
    if own["settings"] not in ("all", "defaults"):
        raise ConfigError(f"settings must be all or defaults, got {own['settings']!r}")
    if own["methods"] is not None:
        chosen = [m for m in own["methods"].split(",") if m]
        bad = [m for m in chosen if m not in FAMILIES]
        if bad or not chosen:
            raise ConfigError(f"methods must be a comma-separated list of "
                              f"{', '.join(FAMILIES)}, got {own['methods']!r}")
        own["methods"] = chosen
    return overrides, own


def settings(methods: Sequence[str] | None, which: str = "all",
             ranks: int | None = None) -> list[Setting]:
    """The rows to estimate: `methods`' settings (None: every method's), or with `which`
    defaults only each method at its defaults; with `ranks`, also each chosen method at its
    defaults as one rank of an fsdp run over that many (a method that cannot be sharded: its
    one-line refusal as the row)."""
    chosen = [s for s in SETTINGS if (methods is None or s.method in methods)
              and (which == "all" or not s.params)]
    if "none" not in [s.method for s in chosen]:  # the baseline row is always there
        chosen.insert(0, SETTINGS[0])
    if ranks:  # fsdp beside each chosen method, at its defaults
        chosen += [Setting(m, ranks=ranks) for m in dict.fromkeys(s.method for s in chosen)]
    return chosen


# ---------------------------------------------------------------- committed rows


def _results_dir() -> Path:
    """docs/results of the checkout the package runs from (absent in an installed wheel)."""
    return Path(__file__).resolve().parents[1] / "docs" / "results"


def committed_rows() -> list[tuple[str, dict[str, Any]]]:
    """Every committed run row (docs/results/**/summary.csv), with its file relative to the
    checkout; [] without a checkout."""
    root = _results_dir()
    if not root.is_dir():
        return []
    import pandas as pd

    out = []
    for f in sorted(root.rglob("summary.csv")):
        rel = f.relative_to(root.parents[1]).as_posix()
        for r in pd.read_csv(f).to_dict("records"):
            out.append((rel, {k: v for k, v in r.items() if not _missing(v)}))
    return out


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _same(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def _matches(row: dict, s: Setting, defaults: dict[str, Any]) -> bool:
    """A committed row of this setting: its method, and each of the setting's method options
    (the ones it sets, and the defaults of the ones other settings vary) where the row has
    them."""
    if row.get("method") != s.method or row.get("status") != "ok":
        return False
    wanted = dict(defaults)
    wanted.update(p.split("=", 1) for p in s.params)
    return all(_same(row[k], v) for k, v in wanted.items() if k in row)


def overhead_from_rows(s: Setting, model: str, rows, defaults) -> tuple[float, str] | None:
    """The median `step_time_rel - 1` of the committed rows of this setting, CUDA rows before
    CPU rows, the same model before any other; and where it came from."""
    import statistics

    found = [(f, r) for f, r in rows if _matches(r, s, defaults) and "step_time_rel" in r]
    for device, what in (("cuda", "committed CUDA rows"), ("cpu", "measured CPU rows")):
        on = [(f, r) for f, r in found if str(r.get("device", "")).startswith(device)]
        for same in (True, False):
            pick = [(f, r) for f, r in on if (r.get("model") == model) == same]
            if pick:
                files = sorted({f for f, _ in pick})
                models = "" if same else \
                    f"other models: {', '.join(sorted({str(r.get('model')) for _, r in pick}))}; "
                return (statistics.median(r["step_time_rel"] for _, r in pick) - 1,
                        f"{what} ({models}{len(pick)} rows: {', '.join(files)})")
    return None


def estimate_error(s: Setting, cfg, model: str, batch: int, rows,
                   defaults) -> tuple[float, str] | None:
    """The estimate's measured error where a committed row measured this very setting (model,
    batch, input size, precision): its `mem_estimate_bytes` over its tracked peak, less 1."""
    want = {"model": model, "trainer.batch_size": batch,
            "trainer.precision": cfg.trainer.precision,
            "dataset.image_size": cfg.dataset.get("image_size"),
            "dataset.seq_len": cfg.dataset.get("seq_len")}
    for f, r in rows:
        if not _matches(r, s, defaults) or "mem_estimate_bytes" not in r \
                or "mem_tracker_peak_bytes" not in r:
            continue
        if all(v is None or (k in r and _same(r[k], v)) for k, v in want.items()):
            return r["mem_estimate_bytes"] / r["mem_tracker_peak_bytes"] - 1, f
    return None


# ---------------------------------------------------------------- the estimates


class Estimator:
    """Full estimates of one setting, cached by batch."""

    def __init__(self, cfg, data, make_model, make_optimizer, ranks: int = 1):
        self.cfg, self.data, self.ranks = cfg, data, ranks
        self.make_model, self.make_optimizer = make_model, make_optimizer
        self.cache: dict[int, dict[str, Any]] = {}
        self.method: Any = None  # the method of the latest estimate (its plan, its declaration)

    def __call__(self, batch: int) -> dict[str, Any]:
        """The estimate at `batch` (per rank under fsdp: the global batch is ranks x it)."""
        if batch not in self.cache:
            def make():
                model, self.method = self.make_model(self.cfg, self.data)
                return model, self.method

            t = self.cfg.trainer
            # the first estimate's warnings are the method's word on this model (a raised
            # budget, nothing to pool); the search's repeat them per batch: kept quiet
            was = logging.root.manager.disable
            if self.cache:
                logging.disable(logging.WARNING)
            try:
                self.cache[batch] = estimate.estimate_peak(
                    make, self.make_optimizer, self.data.input_shape, self.data.num_classes,
                    batch * self.ranks, t.precision, "cpu", self.data.task,
                    "fsdp" if self.ranks > 1 else "single", self.ranks)
            finally:
                logging.disable(was)
        return self.cache[batch]

    def peak(self, batch: int) -> int:
        return int(self(batch)["mem_estimate_bytes"])


# what an estimate's breakdown at a moment holds that grows with the batch (the activations, and
# the batch and labels themselves); the rest (parameters, buffers, gradients, optimizer state and
# the update's temporaries) is the same at every batch
PER_SAMPLE = ("act", "other")


def breakdown_lines(estimate: dict[str, Any], b0: int) -> list[tuple[float, float]]:
    """(intercept, slope) of the peak against the batch at each moment the estimate at batch `b0`
    broke down (the step's peak, the activations' peak), from its per-sample parts alone: the
    peak at batch b is about the largest of the lines, one estimate instead of two."""
    lines = []
    for moment in ("mem_estimate_at_peak_", "mem_estimate_at_act_peak_"):
        parts = {k[len(moment):-len("_bytes")]: v for k, v in estimate.items()
                 if k.startswith(moment) and k.endswith("_bytes")}
        if parts:
            slope = sum(parts.get(k, 0) for k in PER_SAMPLE) / b0
            lines.append((sum(parts.values()) - slope * b0, slope))
    return lines


def largest_batch(peak: Callable[[int], int], budget: int, b0: int,
                  limit: int = BATCH_LIMIT, tries: int = 6,
                  lines: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The largest batch whose `peak` is within `budget`: a first guess where the lines of the
    estimate's breakdown at `b0` (`breakdown_lines`) meet the budget, or else where the line
    through two estimates does; then the line through the estimates nearest to it is solved
    again (secant steps: a peak that moves from one phase to another as the batch grows is
    affine in pieces, and each step lands on the piece where the answer lies) until it fits at
    B and not at B + 1, by full estimates; a bisection over full estimates if the steps do not
    settle. Columns: max_batch, its peak, the peak one above, the slope of the last line, how
    it was found (`breakdown` or `line` when the first guess was right)."""
    fits = lambda b: b >= 1 and peak(b) <= budget  # noqa: E731
    done = lambda b: (b == 0 or fits(b)) and (b >= limit or not fits(b + 1))  # noqa: E731
    first = "breakdown" if lines else "line"
    if lines:  # the largest batch under every line: one estimate (at b0) made the guess
        b = b0
        slope = max(s for _, s in lines)
        under = [math.floor((budget - c) / s) if s > 0 else (limit if c <= budget else 0)
                 for c, s in lines]
        guess = max(0, min(limit, *under))
    else:
        a, b = b0, 2 * b0
        slope = (peak(b) - peak(a)) / (b - a)
    best, how = None, first
    for step in range(tries):
        if step or not lines:
            if slope <= 0:  # nothing grows with the batch here: every batch fits or none does
                guess = limit if peak(b) <= budget else 0
            else:
                guess = max(0, min(limit, math.floor(b + (budget - peak(b)) / slope)))
        if done(guess):
            best, how = guess, first if step == 0 else f"{first}, {step} secant steps"
            break
        nxt = max(guess, 1) if guess != b else guess + 1
        a, b = b, nxt
        slope = (peak(b) - peak(a)) / (b - a)
    if best is None:  # bisection between a batch that fits (or 0) and one that does not
        lo, hi = 0, 1
        while hi <= limit and fits(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1 and lo < limit:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        best, how = min(lo, limit), "bisection"
    out = {"max_batch": best, "max_batch_how": how, "peak_slope_bytes_per_sample": slope}
    if best >= 1:
        out["peak_at_max_batch_bytes"] = peak(best)
    if best < limit:
        out["peak_at_max_batch_plus1_bytes"] = peak(best + 1)
    out["max_batch_verified"] = done(best)
    return out


# ---------------------------------------------------------------- one call


# options that change neither memory nor time of a step: left out when committed rows are matched
IGNORED = {"dry_run", "profile_repeats", "profile_batch", "backend", "seed", "cuts"}


def _defaults(cfg) -> dict[str, Any]:
    """A method's scalar options as committed rows name them (`method.bits`)."""
    return {f"method.{k}": v for k, v in cfg.method.items()
            if not str(k).startswith("_") and k not in IGNORED and v is not None
            and not hasattr(v, "keys")}


def will_fit(overrides: Sequence[str], out_dir: str | Path | None = None,
             methods: Sequence[str] | None = None, card: str | None = None,
             figure: bool = True, progress: Callable[[str], None] | None = None,
             defaults_only: bool = False) -> Answer:
    """The table and the answer for the overrides (memtrain's, plus this command's own `card=`,
    `methods=`, `settings=`, `out=`); rows, answer and figure written to `out_dir` (None: not
    written). `defaults_only`: each method at its defaults only (`settings=defaults`).
    Bad input raises a one-line ConfigError before anything is written."""
    from memtrain.optim import build_optimizer
    from memtrain.preflight import build_data, kwargs_of
    from memtrain.run import runner

    started = time.perf_counter()
    say = progress or (lambda line: log.info(line))
    extra = [*([f"card={card}"] if card else []),
             *([f"methods={','.join(methods)}"] if methods else []),
             *(["settings=defaults"] if defaults_only else [])]
    base, own = parse([*overrides, *extra])
    out_dir = out_dir if out_dir is not None else own["out"]
    # every check before anything is written: the base config, the card, every setting's own
    cfg, choices = loader.compose(base)
    t = runner.check(cfg)
    model_name = str(choices.get("model"))
    shown = f"{model_name} {cfg.model.name}" if isinstance(cfg.model.get("name"), str) and \
        cfg.model.name != model_name else model_name  # a model by name: timm's convnext_atto
    if t.gpu_memory_gb is None:
        raise ConfigError(f"{COMMAND} needs the card's memory: card=NAME ({', '.join(CARDS)}) "
                          f"or trainer.gpu_memory_gb=GiB")
    chosen = settings(own["methods"], own["settings"], own["ranks"])
    if own["ranks"] and t.batch_size % own["ranks"]:
        raise ConfigError(f"trainer.batch_size={t.batch_size} (the global batch) is not a "
                          f"multiple of ranks={own['ranks']}; use a multiple of {own['ranks']}")
    cfgs, picked = [], []
    for s in chosen:
        c, ch = loader.compose([*base, *s.overrides()[:1 + len(s.params)]])
        runner.check(c)
        cfgs.append(c)
        picked.append(ch)
    cap = int(t.gpu_memory_gb * GiB)
    if t.cuda_context_gb is not None:
        context, source = int(t.cuda_context_gb * GiB), "set"
    else:
        context, source = capacity.ASSUMED_CONTEXT_BYTES, "assumed"
    margin = capacity.Margin(cap, t.max_batch_headroom, context, source)
    budget = margin.budget(context)
    card_info = {"card": own["card"], "gpu_memory_gb": t.gpu_memory_gb, "cap_bytes": cap,
                 "headroom": t.max_batch_headroom, "context_bytes": context,
                 "context_source": source, "budget_bytes": budget,
                 "batch_size": t.batch_size, "model": shown,
                 "precision": t.precision, "optim": str(choices.get("optim"))}
    data = build_data(cfg)
    optim = kwargs_of(cfg.optim)
    make_optimizer = lambda m: build_optimizer(m, **optim)  # noqa: E731
    committed = committed_rows()
    rows, runs = [], []
    for s, c in zip(chosen, cfgs):
        t0 = time.perf_counter()
        say(f"{COMMAND}: {s.label}: estimating batch {t.batch_size} on fake tensors ...")
        rows.append(_row(s, c, model_name, data, make_optimizer, budget, t.batch_size,
                         committed, base))
        rows[-1].update(card_info, estimate_s=round(time.perf_counter() - t0, 3))
        runs.append(_run_row(s, c, picked[len(rows) - 1], rows[-1]))
        r = rows[-1]
        say(f"{COMMAND}: {s.label}: {r['status']}"
            + (f", peak {r['peak_bytes'] / GiB:.3f} GiB, largest batch {r['max_batch']}"
               if r["status"] == "ok" else f": {r.get('error', '')}")
            + f" ({r['estimate_s']:.1f} s)")
    text = answer(rows, t.batch_size)
    result = Answer(rows, text, card_info, out_dir=None if out_dir is None else str(out_dir))
    result.wall_s = round(time.perf_counter() - started, 3)
    if out_dir is not None:
        result.files = write(result, Path(out_dir), figure, runs)
    return result


def _run_row(s: Setting, cfg, choices: dict[str, str], row: dict[str, Any]) -> dict | None:
    """The setting as a probes-only run's row (memtrain-report reads it like any sweep's):
    the config's columns, the estimate at the batch asked, find_max_batch's columns; None for
    an fsdp row (its run would be a sharded one)."""
    import torch

    from memtrain.run import provenance

    if s.ranks > 1:
        return None
    est = row.get("estimate", {})
    out = {**loader.identity(cfg, choices), **provenance.of_run(torch.device("cpu")),
           "status": "ok" if row["status"] == "ok" else "error"}
    if row["status"] != "ok":
        return {**out, "error": row.get("error", "")}
    out.update({k: v for k, v in est.items() if k.startswith("mem_estimate_")})
    if row.get("grads_exact") is not None:
        out["grads_exact"] = row["grads_exact"]
    out.update(max_batch_size=row["max_batch"], max_batch_budget_bytes=row["budget_bytes"],
               max_batch_context_bytes=row["context_bytes"],
               max_batch_context_source=row["context_source"])
    return out


def _row(s: Setting, cfg, model_name: str, data, make_optimizer, budget: int, batch: int,
         committed, base: Sequence[str] = ()) -> dict[str, Any]:
    from memtrain.run import runner

    defaults = _defaults(cfg)
    est = Estimator(cfg, data, runner.make_model, make_optimizer, s.ranks)
    row: dict[str, Any] = {"setting": s.label, "method": s.method,
                           "overrides": " ".join(s.overrides()), "status": "ok",
                           "ranks": s.ranks}
    try:
        first = est(batch // s.ranks)
    except ConfigError as e:  # the method refuses this model (prune with nothing to prune)
        return {**row, "status": "refused", "error": str(e)}
    except Exception as e:  # an op without a fake implementation: the estimate's failure
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    method = est.method
    exact = getattr(method, "grads_exact", None)
    row.update({"grads_exact": exact, "peak_bytes": int(first["mem_estimate_bytes"]),
                "act_bytes": int(first["mem_estimate_act_bytes"])})
    row.update({k.replace("mem_estimate_at_peak_", "at_peak_"): int(v) for k, v in first.items()
                if k.startswith("mem_estimate_at_peak_")})
    if "mem_estimate_phase" in first:
        row["phase"] = first["mem_estimate_phase"]
    row["estimate"] = first  # the estimate's own columns, for the run rows (not the table's)
    row["fits"] = row["peak_bytes"] <= budget
    row["headroom_bytes"] = budget - row["peak_bytes"]
    # a recomputing method (or a stack's member): its plan, and the budget it was raised to
    planner = next((m for m in [method, *getattr(method, "members", [])]
                    if getattr(m, "plan", None) is not None), None)
    plan = None if planner is None else planner.plan
    if getattr(planner, "raised_to", None) is not None:
        row["plan_budget_raised_to_bytes"] = int(planner.raised_to)
    refused: list[str] = []

    def peak(b: int) -> int:
        try:
            return est.peak(b)
        except ConfigError as e:  # the method refuses that batch (prune's blocks need rows)
            refused.append(f"batch {b} refused: {e}")
            return budget + 1  # it does not run there, so it does not fit there

    found_batch = largest_batch(peak, budget, batch // s.ranks,
                                lines=breakdown_lines(first, batch // s.ranks))
    if refused:
        found_batch["max_batch_how"] += f"; {refused[0]}"
    if s.ranks > 1:  # the global batch: every rank's
        found_batch["max_batch_per_rank"] = found_batch["max_batch"]
        found_batch["max_batch"] *= s.ranks
    row.update(found_batch, estimates=len(est.cache))  # full estimates this row took
    # the step-time overhead: none is the reference; a checkpoint plan's own cost model; else
    # the committed rows of the same setting
    found = overhead_from_rows(s, model_name, committed, defaults)
    if s.ranks > 1:
        row.update(overhead=None, overhead_source="unknown: fsdp's communication is not "
                                                  "modelled (the peak is one rank's)")
    elif s.method == "none":
        row.update(overhead=0.0, overhead_source="the reference")
    elif plan is not None and math.isfinite(getattr(plan, "overhead", float("nan"))) \
            and s.method == "checkpoint":
        row.update(overhead=float(plan.overhead),
                   overhead_source=f"the planner's cost model (cost={planner.cost}, on fake "
                                   f"tensors)")
    elif found is not None:
        row.update(overhead=found[0], overhead_source=found[1])
    else:
        row.update(overhead=None, overhead_source="unknown: no committed row of this setting")
    err = estimate_error(s, cfg, model_name, batch, committed, defaults)
    if err is not None:
        row.update(estimate_error=err[0], estimate_error_source=err[1])
    if exact is False:
        row["accuracy_evidence"] = EVIDENCE.get(s.method, "none committed")
        row["accuracy_command"] = sweep_command(s, base)
    return row


def sweep_command(s: Setting, base: Sequence[str]) -> str:
    """The sweep that measures this setting's accuracy against none over three seeds on the
    user's data: the variants sweeper (none has no options of the other method), the user's
    overrides but the card's."""
    card = ("trainer.gpu_memory_gb=", "trainer.cuda_context_gb=", "trainer.max_batch_headroom=")
    given = [o for o in base if not o.lstrip("+").startswith(card)]
    data = [] if any(o.startswith("dataset=") for o in given) else ["dataset=YOUR_DATASET"]
    variant = " ".join([f"method={s.method}", *s.params])
    return (f"memtrain -m hydra/sweeper=variants 'hydra.sweeper.variants=[\"method=none\","
            f"\"{variant}\"]' {' '.join([*given, *data])} trainer.seed=0,1,2")


# ---------------------------------------------------------------- the answer


def rank_key(row: dict) -> tuple:
    """The ranking (docs/willfit.md): the least predicted overhead first, a known overhead before
    an unknown one, then the smaller peak."""
    o = row.get("overhead")
    return (o is None, o if o is not None else 0.0, row["peak_bytes"])


def answer(rows: list[dict], batch: int) -> str:
    """The one line (docs/willfit.md's ranking): none when it fits; else the cheapest exact
    and the cheapest of all that fit, one process; else fsdp over N ranks where it fits (none
    first, then exact gradients, then the smaller peak)."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("ranks", 1) == 1]
    sharded = [r for r in rows if r["status"] == "ok" and r.get("ranks", 1) > 1 and r["fits"]]
    none = next((r for r in ok if r["method"] == "none"), None)
    if none is not None and none["fits"]:
        return (f"fits with none at batch {batch} (peak {none['peak_bytes'] / GiB:.2f} GiB); "
                f"the largest batch with none: {none['max_batch']}")
    fitting = sorted((r for r in ok if r["fits"]), key=rank_key)
    if not fitting:
        best = max(ok, key=lambda r: r["max_batch"], default=None)
        tail = f"; the largest batch of any: {best['max_batch']} with {best['setting']}" \
            if best and best["max_batch"] else ""
        if sharded:
            r = min(sharded, key=lambda r: (r["method"] != "none", not r.get("grads_exact"),
                                            r["peak_bytes"]))
            return (f"no single method or stack fits batch {batch} on this card{tail}; fsdp "
                    f"over {r['ranks']} ranks would: {r['setting']} (peak "
                    f"{r['peak_bytes'] / GiB:.2f} GiB per rank)")
        return f"no method or stack fits batch {batch} on this card{tail}"

    def say(r: dict) -> str:
        o = r.get("overhead")
        cost = "overhead unknown" if o is None else f"{100 * o:+.0f}% step time"
        return f"{r['setting']} ({cost}, largest batch {r['max_batch']})"

    exact = [r for r in fitting if r.get("grads_exact")]
    parts = []
    if exact:
        parts.append(f"cheapest with exact gradients that fits: {say(exact[0])}")
    if not exact or fitting[0] is not exact[0]:
        parts.append(f"cheapest that fits: {say(fitting[0])}"
                     + ("" if fitting[0].get("grads_exact") else " (approximate gradients)"))
    return "; ".join(parts)


# ---------------------------------------------------------------- output


COLUMNS = ("setting", "status", "grads_exact", "peak_bytes", "fits", "headroom_bytes",
           "max_batch", "overhead", "overhead_source")


def table(result: Answer) -> str:
    """The terminal table: one line per setting, ranked, then the answer and what the estimate
    leaves out."""
    c = result.card
    head = (f"{c['model']} batch {c['batch_size']} {c['precision']} {c['optim']} on "
            f"{c['card'] or 'a card'} of {c['gpu_memory_gb']:g} GiB: budget "
            f"{c['budget_bytes'] / GiB:.2f} GiB = {1 - c['headroom']:.2f} x cap - CUDA context "
            f"{c['context_bytes'] / GiB:.2f} GiB ({c['context_source']})")
    lines = [head, f"{'setting':<34} {'grads':<6} {'peak GiB':>9} {'fits':<4} "
                   f"{'free GiB':>9} {'max batch':>9} {'overhead':>9}  source"]
    ok = sorted((r for r in result.rows if r["status"] == "ok"),
                key=lambda r: (not r["fits"], *rank_key(r)))
    for r in ok:
        o = r.get("overhead")
        name = r["setting"] + (" *" if "plan_budget_raised_to_bytes" in r else "")
        lines.append(f"{name:<34} {'exact' if r.get('grads_exact') else 'approx':<6} "
                     f"{r['peak_bytes'] / GiB:>9.3f} {'yes' if r['fits'] else 'no':<4} "
                     f"{r['headroom_bytes'] / GiB:>9.3f} {r['max_batch']:>9} "
                     f"{'?' if o is None else f'{100 * o:+.0f}%':>9}  {r['overhead_source']}")
    for r in result.rows:
        if r["status"] != "ok":
            lines.append(f"{r['setting']:<34} {r['status']}: {r.get('error', '')}")
    if any("plan_budget_raised_to_bytes" in r for r in ok):
        lines.append("* below the least feasible plan: planned at the least feasible peak")
    lines += [f"answer: {result.answer}", f"the estimate leaves out: {result.leaves_out}"]
    return "\n".join(lines)


def write(result: Answer, out: Path, figure: bool = True,
          runs: Sequence[dict | None] = ()) -> list[str]:
    """willfit.csv, willfit.json (rows, card, answer) and willfit.png in `out`; each setting's
    row as a run's, runs/<num>_<run_id>/summary.json (`memtrain-report DIR/runs`)."""
    import pandas as pd

    from memtrain import record

    out.mkdir(parents=True, exist_ok=True)
    for num, run in enumerate(runs):
        if run is not None:
            folder = out / "runs" / f"{num}_{run['run_id']}"
            folder.mkdir(parents=True, exist_ok=True)
            record.write_summary(folder, {**run, "run_dir": str(folder)})
    pd.DataFrame([{k: v for k, v in r.items() if k != "estimate"} for r in result.rows]) \
        .to_csv(out / "willfit.csv", index=False)
    (out / "willfit.json").write_text(json.dumps(asdict(result), indent=1, default=str) + "\n")
    files = ["willfit.csv", "willfit.json", *(["runs/"] if any(runs) else [])]
    if figure:
        plot(result, out / "willfit.png")
        files.append("willfit.png")
    return files


def plot(result: Answer, path: Path) -> None:
    """Estimated peak against predicted overhead, the budget and the card as lines, exact
    gradients as circles, approximate ones as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [(100 * r["overhead"], r["peak_bytes"] / GiB, r) for r in result.rows
              if r["status"] == "ok" and r.get("overhead") is not None]
    xs, ys = [p[0] for p in points] or [0], [p[1] for p in points] or [0]
    dx, dy = 0.05 * (max(xs) - min(xs) or 1), 0.04 * (max(ys) - min(ys) or 1)
    labelled: list[tuple[float, float]] = []
    for x, y, r in points:
        ax.scatter([x], [y], marker="o" if r.get("grads_exact") else "x",
                   color="tab:blue" if r.get("grads_exact") else "tab:red")
        near = sum(abs(x - a) < dx and abs(y - b) < dy for a, b in labelled)
        ax.annotate(r["setting"], (x, y), fontsize=7, xytext=(3, 3 + 9 * near),
                    textcoords="offset points")  # points close together: labels stacked
        labelled.append((x, y))
    c = result.card
    ax.axhline(c["cap_bytes"] / GiB, color="k", lw=1, label=f"card {c['gpu_memory_gb']:g} GiB")
    ax.axhline(c["budget_bytes"] / GiB, color="k", lw=1, ls="--",
               label="budget (headroom, CUDA context)")
    ax.set_xlabel("predicted step-time overhead (%)")
    ax.set_ylabel("estimated peak (GiB)")
    ax.set_title(f"{c['model']}, batch {c['batch_size']}: o exact, x approximate gradients",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


HELP = f"""{COMMAND}: will it fit, and at what cost. For a model, a batch and a card, every method
and stack of memtrain: the estimated peak (fake tensors, no GPU), fits or not, the largest batch,
the predicted step-time overhead and its source, exact or approximate gradients.

  {COMMAND} model=resnet50 dataset.image_size=224 trainer.batch_size=256 card=rtx4090
  {COMMAND} model=gpt2_small dataset.seq_len=1024 trainer.batch_size=8 trainer.gpu_memory_gb=24

Options beside memtrain's overrides:
  card=NAME           {', '.join(f'{k} {v:g} GiB' for k, v in CARDS.items())}
  methods=a,b         only these ({', '.join(FAMILIES)}); none is always estimated
  settings=defaults   each method at its defaults only (all: also the settings that change
                      its memory; the default)
  ranks=N             also none (and checkpoint, where chosen) as one rank of an fsdp run
                      over N ranks
  out=DIR             rows and figure (default runs/willfit/<date>/<time>/<model>)
Docs: docs/willfit.md."""


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: the table, the answer, the files; exit 2 with one line on bad
    input, before anything is written."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return
    logging.basicConfig(level=logging.WARNING)
    try:
        base, own = parse(args)
        out = own["out"]
        if out is None:
            model = next((o.split("=", 1)[1] for o in base if o.startswith("model=")), "model")
            out = Path("runs/willfit") / time.strftime("%Y-%m-%d/%H-%M-%S") / f"{model}"
        result = will_fit(args, out_dir=out, progress=lambda line: print(line, file=sys.stderr))
    except ConfigError as e:
        print(f"{COMMAND}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(table(result))
    print(f"rows and figure: {result.out_dir} ({', '.join(result.files)}; {result.wall_s:.0f} s)")


if __name__ == "__main__":
    main()
