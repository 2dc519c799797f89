"""What `make results` runs: the parts of the study, their sizes and their command lines.

Every measurement is a command a user could type (`memtrain -m ...`, `python -m
benchmarks.overhead`, `python -m benchmarks.kernels prune`, `pytest -m gpu`), so the
study measures exactly what users get. Sizes live in PROFILES, one dict per part; every value can
be changed from the command line (`--set pool.batches=64`). `gpu` is the CUDA study (its
PRIORITY parts in one call of CALL_S, the rest while time remains); `cpu` the same study at a
size this project's 2-core CPU runs in minutes; `smoke` the smallest size that still runs every
command (the CI test and the rehearsal of the GPU call).

Budgets (`job_s` per job, `start_s` per process) are estimates for an H100 in the `gpu` profile,
never measurements: resnet50 at 224 px runs ~1500 img/s (fp32 with TF32 convolutions) to ~3000
(bf16), so 20 steps at batch 128 take seconds and a job's fixed costs (model build, the
accounting step under the live-tensor tracker, one evaluation batch) dominate; torch.compile of
resnet50 (train and eval graphs) ~60 s. Each part's measured seconds are recorded beside its
budget, so the first GPU run corrects them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The one call on a CUDA machine (scripts/gpu-results.sh): the parts in priority order, the most
# valuable figures first, so that a call cut off anywhere has measured those. PRIORITY's parts
# run whatever their budget; the REST (the whole study) only where a step's budget still fits.
PRIORITY = ("tests", "table", "monet", "papers")
REST = ("baseline", "pool", "prune", "checkpoint", "synthetic", "tradeoff", "probes")
PARTS = PRIORITY + REST
METHODS = "none,pool,prune,checkpoint,synthetic"
CALL_S = 480  # the one call's command time, installs included, of a 600 s command limit
INSTALL_S = 30  # the script's installs (Hydra's wheels, memtrain editable) before the driver
# Each priority part's budget (s) on an H100 in the `gpu` profile: its steps' budgets fit in it
# and its steps are stopped at PART_CAP x it, so a hang cannot take the next parts' time
# (tests/test_study_call.py holds INSTALL_S + these to CALL_S)
BUDGETS = {"tests": 60, "table": 210, "monet": 70, "papers": 90}
PART_CAP = 2.0

_GPU: dict[str, dict] = {
    # a step is stopped after timeout_factor x its budget + 120 s (a hang must not eat the study)
    "study": dict(timeout_factor=3.0),
    # the resnet50 cells the baseline measures; pool and checkpoint reuse its `none` rows
    "resnet50": dict(image_size=224, batches="64,128", precisions="fp32,bf16", steps=20,
                     warmup=3, start_s=10, job_s=6),
    "tests": dict(paths="gpu-marked", budget_s=60),  # gpu-marked: the files that mark gpu
    # the CUDA table: fixed sizes, so that GPUs compare; none and checkpoint in fp32 and bf16
    # autocast, the other methods at their defaults in fp32, each with the GPU-free estimate
    "table": dict(image_model="resnet50", image_size=224, image_batch=128,
                  image_others="pool,quantize,offload", text_model="gpt2_small", seq_len=1024,
                  text_batch=8, text_others="quantize,offload", precisions="fp32,bf16",
                  steps=6, warmup=2, job_s=12),
    # MONeT's point: the op-level plan at 0.40x of none's activation peak, the block plan beside
    "monet": dict(model="resnet50", image_size=224, batch=184, budget=0.4, steps=10, warmup=3,
                  job_s=15),
    # the seed papers' ratios: pool on resnet50, prune on resmlp24, quantize at 2 bits
    "papers": dict(model="resnet50", image_size=224, batch=64, prune_model="resmlp24",
                   prune_batch=64, prune_image_size=224, bits=2, steps=6, warmup=2, job_s=12),
    "baseline": dict(overhead_batch=64, overhead_steps=20, overhead_rounds=3, overhead_s=45),
    "pool": dict(batches="128", precisions="fp32,bf16", kernel_sizes="2,4",
                 targets="conv,conv+bn", job_s=8),
    "prune": dict(model="resmlp24", image_size=224, batch=64, precisions="bf16,fp32",
                  sparsities="0.5,0.75,0.9", block=32, steps=20, warmup=3, job_s=7,
                  kernel_batch=64, kernel_dtypes="bf16,fp32", kernel_blocks="16,32,64",
                  kernel_s=75),
    "checkpoint": dict(batch=128, precision="fp32", budgets="0.3,0.4,0.6,0.8", compile=True,
                       strategies="uniform,sqrt,selective", job_s=10, compile_job_s=60),
    "synthetic": dict(model="mlp6", image_size=28, channels=1, batch=128, epochs=3,
                      train_size=10000, partitions="2,3,4", job_s=8),
    "tradeoff": dict(image_size=32, batch=128, steps=400, eval_batches=8, job_s=10),
    "probes": dict(model="resnet50", image_size=224, methods=METHODS, prune_model="resmlp24",
                   batch=64, precision="fp32", cap_gb=8.0, steps=20, warmup=3, job_s=12),
}


def _smaller(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for part, values in changes.items():
        out[part].update(values)
    return out


# The CPU study: same parts, tiny sizes. No bf16 (CPU bf16 convolutions ran ~10x slower than
# fp32 here: resnet50 64 px batch 8, 40.7 s vs 3.9 s per step) and no torch.compile (on the CPU
# the tracker runs compiled code eagerly, so compile's memory is only measured on CUDA).
_CPU = _smaller(_GPU, {
    "study": dict(timeout_factor=10.0),  # a shared CPU's load changes step times tenfold
    "resnet50": dict(image_size=64, batches="2,4", precisions="fp32", steps=4, warmup=1,
                     start_s=8, job_s=12),
    "tests": dict(paths="tests/test_gpu.py", budget_s=20),
    # no offload on a CPU run (nothing to offload to: the runner refuses it)
    "table": dict(image_size=64, image_batch=4, image_others="pool,quantize",
                  text_model="gpt_nano", seq_len=128, text_batch=2, text_others="quantize",
                  precisions="fp32", steps=3, warmup=1, job_s=20),
    "monet": dict(image_size=64, batch=4, steps=3, warmup=1, job_s=25),
    "papers": dict(image_size=64, batch=4, prune_model="resmlp12", prune_batch=4,
                   prune_image_size=64, steps=3, warmup=1, job_s=20),
    "baseline": dict(overhead_batch=2, overhead_steps=4, overhead_rounds=2, overhead_s=40),
    "pool": dict(batches="4", precisions="fp32", job_s=12),
    "prune": dict(image_size=128, batch=2, precisions="fp32", steps=4, warmup=1, job_s=10,
                  kernel_batch=2, kernel_dtypes="fp32", kernel_blocks="32", kernel_s=20),
    "checkpoint": dict(batch=4, compile=False, job_s=15),
    "synthetic": dict(epochs=1, train_size=2048, job_s=6),
    "tradeoff": dict(image_size=16, batch=32, steps=20, eval_batches=8, job_s=12),
    # cap above resnet18's fixed 145.9 MiB (parameters, gradients, SGD state): at 0.13 GiB
    # (2026-11-23) no batch fitted for any method
    "probes": dict(model="resnet18", image_size=16, batch=2, cap_gb=0.16, steps=4, warmup=1,
                   prune_model="resmlp12", job_s=15),
})

# The smallest size at which every command still runs (CI).
_SMOKE = _smaller(_CPU, {
    "resnet50": dict(image_size=16, batches="2", steps=2, warmup=0, job_s=8),
    "table": dict(image_size=16, image_batch=2, seq_len=32, steps=2, warmup=0, job_s=10),
    "monet": dict(image_size=16, batch=2, steps=2, warmup=0, job_s=12),
    # prune at the prune part's smoke size (at 16 px too few rows for its blocks)
    "papers": dict(image_size=16, batch=2, prune_image_size=32, prune_batch=2, steps=2,
                   warmup=0, job_s=12),
    # the files that mark gpu tests, as on the GPU machine (here they skip, saying why)
    "tests": dict(paths="gpu-marked"),
    "baseline": dict(overhead_steps=2, overhead_rounds=1, overhead_s=20),
    "pool": dict(batches="2", kernel_sizes="2", targets="conv"),
    "prune": dict(image_size=32, sparsities="0.5", steps=2, warmup=0, kernel_blocks="16",
                  kernel_s=15),
    "checkpoint": dict(batch=2, budgets="0.6", strategies="sqrt"),
    "synthetic": dict(image_size=8, batch=16, train_size=32, partitions="2"),
    # batch 32: prune's 32x32 blocks run along the batch; below it prune is refused on mlp6
    "tradeoff": dict(image_size=8, batch=32, steps=2, eval_batches=1),
    "probes": dict(image_size=8, methods="none,pool", cap_gb=0.05, steps=2, warmup=0),
})

PROFILES = {"gpu": _GPU, "cpu": _CPU, "smoke": _SMOKE}


def apply_sets(profile: dict, sets: list[str]) -> dict:
    """`part.key=value` overrides, typed like the value they replace; a bad one raises
    ValueError naming the valid keys."""
    out = copy.deepcopy(profile)
    for item in sets:
        key, sep, value = item.partition("=")
        part, _, name = key.partition(".")
        if not sep or part not in out or name not in out[part]:
            valid = ", ".join(f"{p}.{k}" for p in out for k in out[p])
            raise ValueError(f"--set {item!r}: expected PART.KEY=VALUE with one of: {valid}")
        old = out[part][name]
        try:
            if isinstance(old, bool):
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                new = value.lower() == "true"
            else:
                new = type(old)(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {key} takes a {type(old).__name__}, like "
                             f"{old!r}") from None
        out[part][name] = new
    return out


@dataclass
class Step:
    """One command of a part. `argv` follows the Python executable."""

    part: str
    name: str
    argv: list[str]
    budget_s: float
    out: Path | None = None  # a file the step writes (benchmark table, junit xml)


@dataclass
class Context:
    device: str  # cuda | cpu
    runs: Path  # the study's raw results: <runs>/<part>/<step>/...
    size: dict
    has_none: Callable[[dict], bool] = lambda where: False  # an ok none run with these values?

    def sweep(self, part: str, name: str, overrides: list[str], jobs: int, job_s: float,
              start_s: float | None = None) -> Step:
        """A `memtrain -m` multirun into <runs>/<part>/<name>, its own report left to the end."""
        common = [f"trainer.device={self.device}", "trainer.progress=false",
                  "trainer.log_every=1000", "trainer.seed=0",
                  f"hydra.sweep.dir={self.runs / part / name}",
                  "+hydra.callbacks.report.enabled=false"]
        start = self.size["resnet50"]["start_s"] if start_s is None else start_s
        return Step(part, name, ["-m", "memtrain", "-m", *overrides, *common],
                    start + jobs * job_s)


def _n(values: str) -> int:
    return len(str(values).split(","))


def _cells(ctx: Context, batches: str, precisions: str) -> list[str]:
    r = ctx.size["resnet50"]
    return ["model=resnet50", "dataset=synthetic", f"dataset.image_size={r['image_size']}",
            f"trainer.batch_size={batches}", f"trainer.precision={precisions}",
            f"trainer.max_steps={r['steps']}", f"trainer.warmup_steps={r['warmup']}",
            "trainer.eval_max_batches=1"]


def _none_unless_measured(ctx: Context, part: str, batches: str, precisions: str) -> list[Step]:
    """`none` at these cells, unless the baseline part already left an ok run for each."""
    r = ctx.size["resnet50"]
    cells = [{"model": "resnet50", "dataset.image_size": r["image_size"],
              "trainer.batch_size": int(b), "trainer.precision": p,
              "trainer.max_steps": r["steps"], "trainer.warmup_steps": r["warmup"]}
             for b in str(batches).split(",") for p in str(precisions).split(",")]
    if all(ctx.has_none(c) for c in cells):
        return []
    return [ctx.sweep(part, "none", ["method=none", *_cells(ctx, batches, precisions)],
                      len(cells), r["job_s"])]


CHECKOUT = Path(__file__).resolve().parents[2]


def gpu_marked(root: Path = CHECKOUT) -> list[str]:
    """The test files that mark a test gpu, relative to the checkout `root` (where the call
    runs pytest): pytest collects only those (collecting the whole suite would import every
    tool and model first)."""
    return sorted(f"tests/{f.name}" for f in (root / "tests").glob("test_*.py")
                  if "mark.gpu" in f.read_text())


def tests(ctx: Context) -> list[Step]:
    s = ctx.size["tests"]
    xml = ctx.runs / "tests" / "junit.xml"
    paths = gpu_marked() if s["paths"] == "gpu-marked" else s["paths"].split(",")
    # -rA: one line per test in the log, kept even when a timeout stops pytest before its xml
    return [Step("tests", "pytest", ["-m", "pytest", "-m", "gpu", "-q", "-rA",
                                     "-p", "no:cacheprovider", f"--junitxml={xml}", *paths],
                 s["budget_s"], xml)]


def _timed(s: dict, model: str, size: list[str], batch: int, precision: str) -> list[str]:
    """A few timed steps on synthetic data, the GPU-free estimate of the same job beside them."""
    return [f"model={model}", *size, f"trainer.batch_size={batch}",
            f"trainer.precision={precision}", f"trainer.max_steps={s['steps']}",
            f"trainer.warmup_steps={s['warmup']}", "trainer.eval_max_batches=1",
            "trainer.estimate=true"]


def table(ctx: Context) -> list[Step]:
    """The CUDA table: an image model and a language model at fixed sizes; none and checkpoint
    in each precision, the other methods at their defaults in fp32. One process per sweep
    (Hydra's basic launcher runs its jobs one after the other in it)."""
    s = ctx.size["table"]
    image = ["dataset=synthetic", f"dataset.image_size={s['image_size']}"]
    text = [f"dataset.seq_len={s['seq_len']}", f"model.context={s['seq_len']}"]
    steps = []
    for tag, model, size, batch, others in (
            ("image", s["image_model"], image, s["image_batch"], s["image_others"]),
            ("text", s["text_model"], text, s["text_batch"], s["text_others"])):
        steps.append(ctx.sweep("table", tag, ["method=none,checkpoint",
                                              *_timed(s, model, size, batch, s["precisions"])],
                               2 * _n(s["precisions"]), s["job_s"]))
        if others:
            steps.append(ctx.sweep("table", f"{tag}_others",
                                   [f"method={others}", *_timed(s, model, size, batch, "fp32")],
                                   _n(others), s["job_s"]))
    return steps


def monet(ctx: Context) -> list[Step]:
    """MONeT's point: checkpoint's op-level plan at `budget` x none's activation peak, the
    block plan at the same budget beside it, and none for the step-time overhead."""
    s = ctx.size["monet"]
    at = _timed(s, s["model"], ["dataset=synthetic", f"dataset.image_size={s['image_size']}"],
                s["batch"], "fp32")
    return [ctx.sweep("monet", "none", ["method=none", *at], 1, s["job_s"]),
            ctx.sweep("monet", "checkpoint",
                      ["method=checkpoint", "method.strategy=budget",
                       "method.granularity=op,block", f"method.budget_fraction={s['budget']}",
                       *at], 2, s["job_s"])]


def papers(ctx: Context) -> list[Step]:
    """The seed papers' ratios: pool on the image model, quantize at `bits`, prune on the
    ResMLP (where its linear layers have inputs to prune), each beside its none."""
    s = ctx.size["papers"]
    image = ["dataset=synthetic", f"dataset.image_size={s['image_size']}"]
    at = _timed(s, s["model"], image, s["batch"], "fp32")
    return [ctx.sweep("papers", "image", ["method=none,pool", *at], 2, s["job_s"]),
            ctx.sweep("papers", "quantize", ["method=quantize", f"method.bits={s['bits']}",
                                             *at], 1, s["job_s"]),
            ctx.sweep("papers", "prune", ["method=none,prune", "optim=adamw",
                                          *_timed(s, s["prune_model"],
                                                  ["dataset=synthetic", "dataset.image_size="
                                                   f"{s['prune_image_size']}"],
                                                  s["prune_batch"], "fp32")],
                      2, s["job_s"])]


def baseline(ctx: Context) -> list[Step]:
    r, s = ctx.size["resnet50"], ctx.size["baseline"]
    out = ctx.runs / "baseline" / "overhead.md"
    return [
        ctx.sweep("baseline", "none", ["method=none", *_cells(ctx, r["batches"], r["precisions"])],
                  _n(r["batches"]) * _n(r["precisions"]), r["job_s"]),
        Step("baseline", "overhead",
             ["-m", "benchmarks.overhead", "--model", "resnet50",
              "--image-size", str(r["image_size"]), "--batch-size", str(s["overhead_batch"]),
              "--steps", str(s["overhead_steps"]), "--warmup", str(r["warmup"] or 1),
              "--rounds", str(s["overhead_rounds"]), "--device", ctx.device, "--out", str(out)],
             s["overhead_s"], out)]


def pool(ctx: Context) -> list[Step]:
    s = ctx.size["pool"]
    cells = _cells(ctx, s["batches"], s["precisions"])
    n = _n(s["batches"]) * _n(s["precisions"])
    return [*_none_unless_measured(ctx, "pool", s["batches"], s["precisions"]),
            ctx.sweep("pool", "pool", ["method=pool", f"method.kernel_size={s['kernel_sizes']}",
                                       f"method.targets={s['targets']}", *cells],
                      n * _n(s["kernel_sizes"]) * _n(s["targets"]), s["job_s"]),
            # kernel_size 1: only the exact add-ons (ReLU bit masks, max-pool offsets)
            ctx.sweep("pool", "compaction_only", ["method=pool", "method.kernel_size=1", *cells],
                      n, s["job_s"])]


def prune(ctx: Context) -> list[Step]:
    s = ctx.size["prune"]
    out = ctx.runs / "prune" / "kernels.md"
    common = [f"model={s['model']}", "dataset=synthetic", f"dataset.image_size={s['image_size']}",
              f"trainer.batch_size={s['batch']}", f"trainer.precision={s['precisions']}",
              f"trainer.max_steps={s['steps']}", f"trainer.warmup_steps={s['warmup']}",
              "trainer.eval_max_batches=1", "optim=adamw"]
    n = _n(s["precisions"])
    return [Step("prune", "kernels",
                 ["-m", "benchmarks.kernels", "prune", "--batch", str(s["kernel_batch"]),
                  "--dtypes", s["kernel_dtypes"], "--blocks", s["kernel_blocks"],
                  "--sparsity", s["sparsities"], "--out", str(out)], s["kernel_s"], out),
            ctx.sweep("prune", "none", ["method=none", *common], n, s["job_s"]),
            ctx.sweep("prune", "prune", ["method=prune", f"method.sparsity={s['sparsities']}",
                                         f"method.block_size={s['block']}", *common],
                      n * _n(s["sparsities"]), s["job_s"])]


def checkpoint(ctx: Context) -> list[Step]:
    s = ctx.size["checkpoint"]
    cells = _cells(ctx, str(s["batch"]), s["precision"])
    steps = [*_none_unless_measured(ctx, "checkpoint", str(s["batch"]), s["precision"]),
             ctx.sweep("checkpoint", "budget",  # both granularities: the budget figure's series
                       ["method=checkpoint", "method.strategy=budget",
                        "method.granularity=op,block",
                        f"method.budget_fraction={s['budgets']}", *cells],
                       2 * _n(s["budgets"]), s["job_s"])]
    if s["compile"]:  # the peer at the same budgets: torch's activation_memory_budget
        steps.append(ctx.sweep("checkpoint", "compile",
                               ["method=checkpoint", "method.strategy=compile",
                                f"method.budget_fraction={s['budgets']}", *cells],
                               _n(s["budgets"]), s["compile_job_s"]))
    steps.append(ctx.sweep("checkpoint", "strategies",
                           ["method=checkpoint", f"method.strategy={s['strategies']}", *cells],
                           _n(s["strategies"]), s["job_s"]))
    return steps


def synthetic(ctx: Context) -> list[Step]:
    s = ctx.size["synthetic"]
    common = [f"model={s['model']}", "dataset=synthetic", f"dataset.image_size={s['image_size']}",
              f"dataset.channels={s['channels']}", f"dataset.train_size={s['train_size']}",
              f"trainer.batch_size={s['batch']}", f"trainer.epochs={s['epochs']}",
              "optim=adamw"]
    return [ctx.sweep("synthetic", "none", ["method=none", *common], 1, s["job_s"]),
            ctx.sweep("synthetic", "synthetic",
                      ["method=synthetic", f"method.partitions={s['partitions']}", *common],
                      _n(s["partitions"]), s["job_s"])]


def tradeoff(ctx: Context) -> list[Step]:
    """Memory against accuracy: `make run`'s study (experiment=quick: every method at its
    default on resnet18 over the synthetic data), trained long enough to learn."""
    s = ctx.size["tradeoff"]
    return [ctx.sweep("tradeoff", "quick",
                      ["experiment=quick", f"dataset.image_size={s['image_size']}",
                       f"trainer.batch_size={s['batch']}", f"trainer.max_steps={s['steps']}",
                       f"trainer.eval_max_batches={s['eval_batches']}"],
                      _n(METHODS), s["job_s"])]


def probes(ctx: Context) -> list[Step]:
    """Per method: the estimate beside the measured peak of the same job, then (jobs of their
    own, so that one probe's failure hides nothing of the other) find_max_batch under a cap."""
    s = ctx.size["probes"]
    models = [(s["model"], s["methods"], [])]
    if s["prune_model"] and "prune" in s["methods"].split(","):  # where prune has inputs to prune
        models.append((s["prune_model"], "none,prune", ["optim=adamw"]))
    common = ["dataset=synthetic", f"dataset.image_size={s['image_size']}",
              f"trainer.batch_size={s['batch']}", f"trainer.precision={s['precision']}",
              "trainer.eval_max_batches=1"]
    steps = []
    for i, (model, methods, extra) in enumerate(models):
        at = [f"model={model}", f"method={methods}", *extra, *common]
        steps += [ctx.sweep("probes", f"estimate{i}", [*at, "trainer.estimate=true",
                                                       f"trainer.max_steps={s['steps']}",
                                                       f"trainer.warmup_steps={s['warmup']}"],
                            _n(methods), s["job_s"]),
                  ctx.sweep("probes", f"capacity{i}", [*at, "trainer.find_max_batch=true",
                                                       f"trainer.gpu_memory_gb={s['cap_gb']}",
                                                       "trainer.max_steps=0"],
                            _n(methods), s["job_s"])]
    return steps


BUILDERS: dict[str, Callable[[Context], list[Step]]] = {
    "tests": tests, "table": table, "monet": monet, "papers": papers, "baseline": baseline,
    "pool": pool, "prune": prune,
    "checkpoint": checkpoint, "synthetic": synthetic, "tradeoff": tradeoff, "probes": probes}
