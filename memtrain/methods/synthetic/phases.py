"""Partitioned training with synthetic intermediate labels (Karadag & Topaloglu, arXiv 2403.11204).

The model is cut into K sequential partitions at layer/stage boundaries. Cut j gets a fixed random
matrix S_j of shape (cut width, classes), entries kappa * U(0, 1); class c's intermediate label is
column c (reshaped like the cut's output for feature maps). Partition j < K-1 learns, with MSE, to
map its input to S_j[:, y]; the last partition learns the classes with cross-entropy. A later
partition's input is either the frozen earlier partitions' output (`right_input=left`, trained in
order) or S_{j-1}[:, y] plus Gaussian noise (`right_input=synthetic`: the partitions do not depend
on each other and may train in parallel processes). Optional end-to-end recovery epochs follow.
The composed model predicts argmax right(...(left(x))).

The cuts fall between the units of the model's chain (`memtrain.models.chain_of`); automatic
cuts balance the partitions' activation memory on the run's first batch (`cuts.py`). The
partitioned model keeps the plain model's parameter names under any cuts.

Each phase is one call of `train.train` (its loss_fn / evaluate_fn / metric_prefix hooks); only
one partition's parameters, gradients, optimizer state and activations are alive on the device
in a phase: the other partitions wait in host memory (the frozen earlier ones, with
`right_input=left`, are on the device: they make the phase's input). The peak a row reports
counts every parameter and buffer on the run's device during the phase (`train`'s `resident`):
on a GPU the phase's partition (and the frozen prefix), on a CPU, whose host memory is the
device's, every partition.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from memtrain.config.schema import Trainer
from memtrain.data import Data
from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.losses import cross_entropy
from memtrain.methods.base import NO_CONTEXT, MethodContext, ProbeStep
from memtrain.methods.synthetic.cuts import (
    PROFILE_BATCH,
    Partitioned,
    balanced_cuts,
    check_cuts,
    cut_shapes,
    numel,
    profile_units,
)
from memtrain.methods.synthetic.partition import (
    Phase,
    frozen_input,
    label_matrix,
    lr_factors,
    mse_to_label,
    optimizer_spec,
    run_phase,
    synthetic_input,
)
from memtrain.models import chain_of
from memtrain.models.chain import model_class
from memtrain.models.ends import with_ends
from memtrain.run.train import RunFailed, TrainResult, autocast_factory, evaluate

log = logging.getLogger("memtrain.methods.synthetic")  # the name runs have logged under

RIGHT_INPUTS = ("left", "synthetic")
# Per-phase columns copied to the top level from the largest phase (see `_merge`).
TOP_FROM_LARGEST = ("step_time_s_median", "step_time_s_p90", "throughput_samples_s")
# ... except the activation columns, from the phase with the largest activation peak: on mlp6
# the largest total peak is part0's (most of the parameters), the largest activation peak
# part1's, and a row's mem_peak_act_bytes must be the run's largest
ACT_COLUMNS = ("mem_peak_act_bytes", "mem_act_saved_bytes")
ACT_PREFIX = "mem_at_act_peak_"  # the breakdown at the activation peak
# every phase's own; the row's is the largest (the allocator's, and the tracker's own)
ACT_TEMP = ("mem_peak_act_temp_bytes", "mem_tracker_act_temp_bytes")


class Synthetic:
    """Method `synthetic`; the keyword arguments are conf/method/synthetic.yaml's keys.

    Args:
        partitions: K >= 2 sequential partitions.
        cuts: explicit boundaries as unit indices (K-1 of them, increasing); null picks, when
            training starts, the cuts that balance the partitions' activation memory (profiled
            on the run's device and first batch; kept with the resumable state).
        kappa: scale of the synthetic labels, S = kappa * U(0, 1).
        right_input: `synthetic` (the paper's scheme: a partition learns from the previous cut's
            synthetic label plus noise, independently of the others) or `left` (a variant: from
            the frozen earlier partitions' outputs, in order).
        noise: standard deviation of the Gaussian noise on synthetic inputs, as a fraction of kappa.
        epochs_per_partition: epochs of each partition; null = trainer.epochs - recovery_epochs,
            so every layer gets trainer.epochs epochs of updates in all (matched with none).
        recovery_epochs: end-to-end fine-tuning epochs of the composed model afterwards.
        parallel: one worker process per partition (needs right_input=synthetic); one device each
            when several GPUs exist, one after another on a single device.
        seed: seed of the label matrices; null = trainer.seed.
    """

    name = "synthetic"
    grads_exact = False  # each partition trains towards synthetic labels, not the loss

    def __init__(self, partitions: int = 2, cuts: list[int] | None = None, kappa: float = 1.0,
                 right_input: str = "synthetic", noise: float = 0.1,
                 epochs_per_partition: int | None = None, recovery_epochs: int = 0,
                 parallel: bool = False, seed: int | None = None):
        check_range("method.partitions", partitions, 2)
        if cuts is not None:
            cuts = [int(c) for c in cuts]
            if len(cuts) != partitions - 1:
                raise ConfigError(f"method.cuts lists {len(cuts)} boundaries, so it needs "
                                  f"method.partitions={len(cuts) + 1}, got {partitions}")
        check_range("method.kappa", kappa, 0, None, lo_open=True)
        check_choice("method.right_input", right_input, RIGHT_INPUTS)
        check_range("method.noise", noise, 0)
        if epochs_per_partition is not None:
            check_range("method.epochs_per_partition", epochs_per_partition, 1)
        check_range("method.recovery_epochs", recovery_epochs, 0)
        if parallel and right_input != "synthetic":
            raise ConfigError("method.parallel=true needs method.right_input=synthetic (with "
                              "right_input=left each partition waits for the previous one)")
        self.partitions, self.cuts, self.kappa = int(partitions), cuts, float(kappa)
        self.right_input, self.noise = right_input, float(noise)
        self.epochs_per_partition, self.recovery_epochs = epochs_per_partition, recovery_epochs
        self.parallel, self.seed = bool(parallel), seed
        self.labels: list[torch.Tensor] = []  # S_j per cut, set by fit
        self.profile = None  # the UnitProfile automatic cuts were chosen from

    def check_trainer(self, trainer: Trainer) -> None:
        """With `parallel` each partition trains in a worker process of its own, from the
        trainer options alone: the parent's memory timeline, CUDA memory snapshot, resumable
        checkpoints and live logger never see its steps. Asking for one of them is refused in
        one line, before anything runs, rather than ignored."""
        if not self.parallel:
            return
        unseen = [(f"trainer.{key}={shown}", what) for key, shown, asked, what in (
            ("memory_timeline", "true", trainer.memory_timeline, "no timeline of any step"),
            ("memory_snapshot", "true", trainer.memory_snapshot, "no allocation of theirs"),
            ("save_every", trainer.save_every, trainer.save_every > 0, "no checkpoint of theirs"),
            ("logger", trainer.logger, trainer.logger != "csv", "none of their steps"),
        ) if asked]
        if unseen:
            (given, what), key = unseen[0], unseen[0][0].split("=")[0]
            raise ConfigError(f"{given} with method.parallel=true would record {what}: each "
                              f"partition trains in a worker process of its own; use "
                              f"method.parallel=false (the same partitions, one after another "
                              f"in this process) or drop {key}")

    # ------------------------------------------------------------ surgery

    def check_strategy(self, strategy: str) -> None:
        """A sharded run (ddp, fsdp) trains one model across the ranks; synthetic trains its
        partitions one phase after another, each a model of its own with its own loop."""
        raise ConfigError(f"method=synthetic with trainer.strategy={strategy}: synthetic trains "
                          f"its partitions one phase at a time, each a model of its own, which "
                          f"the strategy's wrapper of one model does not cover; use "
                          f"trainer.strategy=single")

    def wrap(self, model: nn.Module) -> Partitioned:
        """The model as `Partitioned` (same parameters and names; the forward gains only the
        fixed `LabelStandardize` at each cut). Explicit cuts apply now; automatic ones when
        `plan` sees the data (a model type without a chain rule is refused here)."""
        if getattr(model, "task", "classify") != "classify":
            raise ConfigError(f"method=synthetic trains each partition to predict synthetic "
                              f"labels of the classes, and {type(model).__name__} is a language "
                              f"model with no classes; use a classifier (vit_tiny, vit_b16, "
                              f"resnet18, mlp6, ...)")
        chain = with_ends(model, chain_of(model, "method synthetic"))
        why = chain.cuttable()
        if why is not None:
            cls = model_class(model)
            raise ConfigError(f"method=synthetic cuts {cls.__name__} between the blocks of the "
                              f"chain found on a sample, and cannot: {why}; a @chain_rule with "
                              f"its entry and head as modules makes it cuttable "
                              f"(memtrain/models/chain.py)")
        units = chain.units()
        parts = Partitioned(model, units, self.kappa)
        params = [numel(u) for u in units]
        have = sum(1 for p in params if p > 0)
        if self.partitions > have:
            raise ConfigError(f"method.partitions={self.partitions} is more than this model "
                              f"allows (at most {have} partitions with parameters)")
        if self.cuts is not None:
            check_cuts(self.cuts, params)
            parts.cut(self.cuts)
        return parts

    def choose_cuts(self, model: Partitioned, x: torch.Tensor, autocast=None) -> list[int]:
        """The cuts that balance the partitions' modelled activation memory, profiled on the first
        `PROFILE_BATCH` samples of the batch `x` (cuts.py): `fit` and the probes both call this."""
        prof = profile_units(model, x[:PROFILE_BATCH], autocast)
        self.profile = prof
        return balanced_cuts([numel(u) for u in model.units], self.partitions,
                             prof.partition_bytes)

    def _cut(self, model: Partitioned, data: Data, trainer: Trainer, device: torch.device,
             ck=None) -> None:
        """Apply the explicit cuts, a resumed run's, or the activation-balanced ones; the
        resumable state (`ck`, the run's Checkpointer) keeps them (a resumed phase's state must
        find the same partitions)."""
        cuts = self.cuts or _resumed_cuts(ck, self.partitions)
        if cuts is None:
            model.to(device)
            n = min(trainer.batch_size, PROFILE_BATCH, len(data.train))
            x, _ = next(iter(data.train.batches(n, device)))
            cuts = self.choose_cuts(model, x, autocast_factory(device.type, trainer.precision)())
            model.cpu()  # back to host memory: each phase moves only what it uses to the device
        model.cut(list(cuts))
        if ck is not None:
            ck.carry["synthetic_cuts"] = list(cuts)

    # ------------------------------------------------------------ training

    def fit(self, model: Partitioned, data: Data, optimizer: torch.optim.Optimizer, scheduler,
            *, trainer: Trainer, device: torch.device, **loop: Any) -> TrainResult:
        """Train every partition on its own target, then recover end to end; one TrainResult.

        `optimizer`/`scheduler` are the run's (built on the whole model): each phase gets a fresh
        optimizer of the same class and settings over its own parameters, and the run's learning
        rate schedule stretched to the phase's length (recovery: the schedule's last steps).
        `loop`: train.train's other keyword arguments (checkpointer, loggers), for every phase.
        """
        phases = self.plan(model, data, optimizer, scheduler, trainer=trainer, device=device,
                           **loop)
        done: list[tuple[str, Any]] = []
        t0 = time.perf_counter()
        try:
            if self.parallel:
                from memtrain.methods.synthetic.workers import run_parallel

                done += run_parallel(phases, data, device)
            else:
                for phase in phases:
                    done.append((phase.name, run_phase(phase, data)))
                    if self.right_input == "synthetic":  # not needed again until composed
                        phase.module.cpu()
            if self.recovery_epochs:
                rec = self._recovery(model, optimizer, scheduler, trainer, device, data, loop)
                done.append((rec.name, run_phase(rec, data)))
        except RunFailed as e:
            summary, metrics = self._merge(done, model)
            summary.update({f"{_failing(phases, done)}.{k}": v for k, v in e.summary.items()})
            raise RunFailed(e.status, str(e), e.step, summary, metrics + e.metrics) from e
        summary, metrics = self._merge(done, model)
        summary["train_time_s"] = time.perf_counter() - t0
        summary.update(self._evaluate(model, data, trainer, device, metrics, summary["steps"]))
        return TrainResult(summary, metrics)

    def plan(self, model: Partitioned, data: Data, optimizer: torch.optim.Optimizer, scheduler,
             *, trainer: Trainer, device: torch.device, **loop: Any) -> list[Phase]:
        """Cut the model (`_cut`), then the label matrices (in `self.labels`) and one Phase per
        partition, in order."""
        self._cut(model, data, trainer, device, loop.get("checkpointer"))
        seed = self.seed if self.seed is not None else trainer.seed
        shapes = cut_shapes(model, data.input_shape)
        self.labels = [label_matrix(seed, j, math.prod(s), data.num_classes, self.kappa)
                       for j, s in enumerate(shapes)]
        run_total = trainer.schedule(len(data.train))[1]
        epochs = self.epochs_per_partition or trainer.epochs - self.recovery_epochs
        if epochs < 1:
            raise ConfigError(f"method.recovery_epochs={self.recovery_epochs} leaves no epochs "
                              f"for the partitions out of trainer.epochs={trainer.epochs}; lower "
                              f"it or set method.epochs_per_partition")
        # the whole model is resident in the phase's process: the tracker counts what of it is
        # on the device (all of it on a CPU, whose host memory is the device's)
        phase_kw = {"trainer": replace(trainer, epochs=epochs), "device": device,
                    "resident": (model,), **loop}
        return [self._phase(j, model, optimizer, scheduler, phase_kw, shapes, run_total,
                            len(data.train)) for j in range(len(model))]

    def probe_steps(self, model: Partitioned, x: torch.Tensor, y: torch.Tensor, *, autocast,
                    num_classes: int, context: MethodContext = NO_CONTEXT) -> list[ProbeStep]:
        """For the probes (`estimate.probe_steps`): one step per phase as `fit` runs it: the
        partition alone on its input (the batch, the previous cut's label plus noise, or the
        frozen earlier partitions' output, made before the step as the phase's data is) against
        its target (this cut's labels by MSE, the classes for the last), then the end-to-end
        recovery step when there is one. Resident beside the partition, as in `fit`: the frozen
        prefix (`right_input=left`), and on a CPU every partition. The label matrices' values
        do not matter here (seed 0)."""
        if not model.cuts:  # explicit cuts were applied in wrap(); automatic ones as fit() does
            model.cut(self.choose_cuts(model, x, autocast()))
        shapes = cut_shapes(model, tuple(x.shape[1:]))
        labels = [label_matrix(0, j, math.prod(s), num_classes, self.kappa)
                  for j, s in enumerate(shapes)]
        steps = []
        for j, part in enumerate(model):
            xj, resident = x, ()
            if x.device.type == "cpu":  # host memory is the device's: every partition stays
                resident = (model,)
            if j and self.right_input == "left":
                prefix = nn.Sequential(*list(model)[:j])
                xj, resident = frozen_input(prefix, x, y), resident or (prefix,)
            elif j:
                xj = synthetic_input(labels[j - 1].t().contiguous(), shapes[j - 1],
                                     self.noise * self.kappa, x, y)
            loss = (partial(mse_to_label, targets=labels[j].t().contiguous())
                    if j < len(model) - 1 else cross_entropy)
            steps.append(ProbeStep(part, xj, y, loss, f"part{j}", resident))
        if self.recovery_epochs:
            steps.append(ProbeStep(model, x, y, cross_entropy, "recovery"))
        return steps

    def _phase(self, j, model, optimizer, scheduler, kw, shapes, run_total, n_train) -> Phase:
        part = model[j]
        total = kw["trainer"].schedule(n_train)[1]
        phase = Phase(name=f"part{j}", module=part, optim=optimizer_spec(optimizer, part),
                      factors=lr_factors(scheduler, run_total, total), train_kwargs=kw,
                      s_out=self.labels[j] if j < len(model) - 1 else None)
        if j > 0:
            phase.in_shape = shapes[j - 1]
            if self.right_input == "left":
                phase.prefix = nn.Sequential(*list(model)[:j])
            else:
                phase.s_in, phase.noise_std = self.labels[j - 1], self.noise * self.kappa
        return phase

    def _recovery(self, model, optimizer, scheduler, trainer: Trainer, device, data: Data,
                  loop: dict[str, Any]) -> Phase:
        per_epoch, run_total = trainer.schedule(len(data.train))
        cap = self.recovery_epochs * max(1, per_epoch)
        rec = replace(trainer, epochs=self.recovery_epochs,
                      max_steps=min(trainer.max_steps, cap) if trainer.max_steps else None)
        model.to(device)
        return Phase(name="recovery", module=model, optim=optimizer_spec(optimizer, model),
                     factors=lr_factors(scheduler, run_total, rec.schedule(len(data.train))[1],
                                        tail=True),
                     train_kwargs={"trainer": rec, "device": device, **loop})

    # ------------------------------------------------------------ records

    def _merge(self, done, model: Partitioned) -> tuple[dict[str, Any], list[dict]]:
        """Per-phase columns `part0.mem_act_saved_bytes`, ...; the usual mem_* columns (and step
        time) from the phase with the largest peak, the activation ones (`ACT_COLUMNS`, the
        breakdown at the activation peak) from the phase with the largest activation peak;
        losses and steps over all phases."""
        summary: dict[str, Any] = {}
        metrics: list[dict] = []
        bounds = model.unit_bounds
        for name, res in done:
            summary.update({f"{name}.{k}": v for k, v in res.summary.items()})
            metrics += res.metrics
            if name.startswith("part"):
                j = int(name[4:])
                summary[f"{name}.params"] = numel(model[j])
                summary[f"{name}.units"] = f"{bounds[j]}-{bounds[j + 1] - 1}"
                summary[f"{name}.mem_labels_bytes"] = self._label_bytes(j, len(model))
        summary["synthetic_cuts"] = ";".join(map(str, model.cuts))
        if not done:
            return summary, metrics
        key = "mem_peak_alloc_bytes"
        largest_name, largest = max(done, key=lambda d: d[1].summary.get(key, 0))
        summary.update({k: v for k, v in largest.summary.items()
                        if k.startswith("mem_") or k in TOP_FROM_LARGEST})
        act_name, act = max(done, key=lambda d: d[1].summary.get("mem_peak_act_bytes", 0))
        summary.update({k: v for k, v in act.summary.items()
                        if k in ACT_COLUMNS or k.startswith(ACT_PREFIX)})
        summary["synthetic_largest_act_phase"] = act_name
        # activations + backward temporaries: the largest phase's own (whichever phase it is)
        for col in ACT_TEMP:
            temp = [r.summary[col] for _, r in done if col in r.summary]
            if temp:
                summary[col] = max(temp)
        summary["mem_peak_rss_bytes"] = max(r.summary.get("mem_peak_rss_bytes", 0)
                                            for _, r in done)
        summary["synthetic_largest_phase"] = largest_name
        summary["train_loss"] = done[-1][1].summary.get("train_loss", float("nan"))
        summary["steps"] = sum(r.summary.get("steps", 0) for _, r in done)
        summary["epochs_done"] = max(r.summary.get("epochs_done", 0) for _, r in done)
        return summary, metrics

    def _label_bytes(self, j: int, k: int) -> int:
        """Bytes of the label matrices partition j holds on its device (its own S and, with
        synthetic inputs, the previous cut's): constants beside the parameters, which the CPU
        tracker's columns do not see (a CUDA peak does)."""
        used = ([self.labels[j]] if j < k - 1 else []) + \
            ([self.labels[j - 1]] if j > 0 and self.right_input == "synthetic" else [])
        return sum(s.numel() * s.element_size() for s in used)

    def _evaluate(self, model, data, t: Trainer, device, metrics, step) -> dict[str, float]:
        """Test accuracy of the composed model: argmax of the last partition's logits."""
        model.to(device)
        res = evaluate(model, data.test, device, t.eval_batch_size or t.batch_size,
                       autocast_factory(device.type, t.precision), t.eval_max_batches,
                       t.channels_last)
        for k, v in res.items():
            metrics.append({"step": step, "epoch": -1, "split": "test", "name": k, "value": v})
        log.info("synthetic: composed model test_acc %.4f", res["acc"])
        return {f"test_{k}": v for k, v in res.items()}


def _resumed_cuts(ck, k: int) -> list[int] | None:
    """The cuts saved with the checkpoint a resumed run continues from, if any."""
    if ck is None or not ck.resume:
        return None
    for prefix in [*(f"part{j}." for j in range(k)), "recovery."]:
        cuts = ((ck.load(prefix) or {}).get("carry") or {}).get("synthetic_cuts")
        if cuts is not None:
            return [int(c) for c in cuts]
    return None


def _failing(phases: list[Phase], done) -> str:
    names = [n for n, _ in done]
    return next((p.name for p in phases if p.name not in names), "recovery")
