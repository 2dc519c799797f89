"""Every column a run's row (summary.json) can hold, declared once: its unit, its kind, what it
means, which part of memtrain writes it, and how the report labels it.

    python -m memtrain.columns --markdown             # the table (docs/outputs.md's reference)
    python -m memtrain.columns --write docs/outputs.md  # put it between the page's markers

A name may be a family: `<option>` stands for any (dotted) option name (`method.<option>`: the
flattened options of conf/method, a stack member's as `method.<member>.<option>`), `<j>` for a
number, `<column>` for any declared column (`part<j>.<column>`: a phase's own copy), and
`{a,b}` for one of the listed words. `label` is the short name of tables and legends (`labels`:
one per option or word of a family), `axis` the longer one of a figure's axis.

`record.write_summary` checks every row it writes against this list: an undeclared column is a
warning in a user's run and an error where MEMTRAIN_STRICT_COLUMNS=1 (the test suite sets it), so
a column a writer adds without declaring it here fails the tests. Imports nothing but the
standard library: the core, the report and the studies all read it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STRICT_ENV = "MEMTRAIN_STRICT_COLUMNS"  # "1": an undeclared column is an error (tests)
BEGIN, END = "<!-- columns:begin (python -m memtrain.columns --write docs/outputs.md) -->", \
    "<!-- columns:end -->"

UNITS = {
    "bytes": "bytes", "s": "seconds", "samples/s": "training samples per second",
    "fraction": "a number in [0, 1] (accuracy: 0.9 = 90%)", "ratio": "a ratio, 1 = equal",
    "count": "a whole number", "bool": "true or false", "text": "text", "path": "a folder or file",
    "time": "a UTC ISO 8601 time", "loss": "a loss value", "option": "as written in conf/",
    "perplexity": "exp(loss per token), 1 or more",
}
# in the order docs/outputs.md lists them
KINDS = {
    "identity": "what ran: the run's id and the option chosen of each config group",
    "config": "every option of the composed config, flattened (`group.key`)",
    "status": "how the run ended, where it stopped, how it continued",
    "provenance": "who measured, where, with which software",
    "run": "the run itself: its data, model size, steps and times",
    "memory": "measured memory of the accounting step or of the timed steps",
    "speed": "timed steps after warm-up",
    "accuracy": "evaluation on the test split, training loss",
    "probe": "before training: `trainer.estimate`, `trainer.find_max_batch`, "
             "`trainer.gpu_memory_gb`",
    "method": "written by one method (its `prepare` or `fit`)",
}


@dataclass(frozen=True)
class Column:
    """One column, or a family of columns (see the module docstring)."""

    name: str
    unit: str
    kind: str
    writer: str  # which part of memtrain writes it
    meaning: str  # one line
    label: str = ""  # short name in tables and legends ("" = the name)
    axis: str = ""  # a figure axis's name ("" = the label)
    labels: Mapping[str, str] = field(default_factory=dict)  # a family's, per option or word

    @property
    def family(self) -> bool:
        return "<" in self.name or "{" in self.name


_IDENTITY_GROUPS = ("method", "model", "dataset", "optim", "trainer", "experiment")
CONFIG_GROUPS = ("method", "trainer", "dataset", "model", "optim")  # flattened into columns
BREAKDOWN = ("params", "grads", "optim", "act", "other")  # the moments' parts (measure.py)
# the tracker's own, and the update's temporaries
ESTIMATE_AT_PEAK = ("params", "buffers", "grads", "optim", "update", "act", "other")
# the live-tensor tracker's categories (memtrain/memory/tracker.py), bottom to top of a timeline:
# `update`: tensors the optimizer step makes and frees (the update's temporaries)
TRACKED = ("params", "buffers", "optim", "update", "grads", "act", "temp", "other")

# What a row's columns mean is versioned: a change of meaning bumps SCHEMA_VERSION, which every
# summary.json carries (`schema_version`; a row without it is version 1), so that rows measured
# before and after a change can be told apart (the report warns when it mixes them).
SCHEMA = "schema_version"
SCHEMA_VERSION = 2
SCHEMA_CHANGES = {
    2: "the CPU's mem_peak_alloc_bytes and mem_peak_act_temp_bytes count every allocation of "
       "the accounting step, kernels' scratch included (mem_peak_source=allocator; before: "
       "the live-tensor tracker's); mem_at_peak_optim_bytes is optimizer state only (before: "
       "with the update's temporaries, now mem_at_peak_update_bytes); checkpoint's RNG states "
       "counted (mem_rng_state_bytes)",
}


# what a row of an older version holds that a row of the version after it does not: the
# generated docs' captions say it of committed rows measured before a change
SCHEMA_BEFORE = {
    2: "CPU peaks are the live-tensor tracker's (no kernel scratch) and the optimizer column "
       "holds the update's temporaries",
}


def schema_caption(versions: Iterable) -> str:
    """What rows of older schema versions hold (for a caption: "" when every row is of the
    current one)."""
    found = sorted({schema_of({SCHEMA: v}) for v in versions})
    old = [v for v in found if v < SCHEMA_VERSION]
    if not old:
        return ""
    what = "; ".join(SCHEMA_BEFORE[v + 1] for v in old if v + 1 in SCHEMA_BEFORE)
    return (f"rows of schema {', '.join(map(str, old))} (measured before schema "
            f"{SCHEMA_VERSION}, memtrain/columns.py): {what}")


def schema_of(row: Mapping) -> int:
    """The schema version a row was written under (1: before versions were recorded)."""
    v = row.get(SCHEMA)
    try:
        return int(v) if v is not None and v == v else 1
    except (TypeError, ValueError):
        return 1


def mixed_schemas(versions: Iterable) -> str:
    """A warning when rows written under several schema versions are read together (a row
    without one is version 1), naming what changed; "" when they share one."""
    found = sorted({schema_of({SCHEMA: v}) for v in versions})
    if len(found) < 2:
        return ""
    changes = "; ".join(f"version {v}: {SCHEMA_CHANGES[v]}" for v in found[1:]
                        if v in SCHEMA_CHANGES)
    return (f"rows of schema versions {', '.join(map(str, found))} read together: their "
            f"columns do not all mean the same ({changes}); compare rows of one version")

# the columns the report and the studies read by name
RUN_ID, STATUS, ERROR, METHOD, RUN_DIR = "run_id", "status", "error", "method", "run_dir"
PEAK, RESERVED, PEAK_SOURCE = "mem_peak_alloc_bytes", "mem_peak_reserved_bytes", "mem_peak_source"
ACT_PEAK, SAVED = "mem_peak_act_bytes", "mem_act_saved_bytes"
ACT_TEMP_PEAK = "mem_peak_act_temp_bytes"  # activations + backward temporaries: the report's
THROUGHPUT, STEP_TIME, STEP_TIME_P90 = ("throughput_samples_s", "step_time_s_median",
                                        "step_time_s_p90")
TEST_ACC, MAX_BATCH = "test_acc", "max_batch_size"
ESTIMATE, ESTIMATE_ACT = "mem_estimate_bytes", "mem_estimate_act_bytes"
ESTIMATE_ACT_TEMP = "mem_estimate_act_temp_bytes"

# method.<option> -> its short name in labels ("" shows the value alone: `pool conv+bn`)
OPTION_LABELS = {
    "kernel_size": "k", "pool_type": "", "mode": "", "targets": "", "relu_mask": "relu",
    "min_size": "min", "compress_input": "input",
    "sparsity": "s", "block_size": "block", "criterion": "", "layers": "", "backend": "",
    "prune_head": "head", "prune_shared": "shared",
    "strategy": "", "granularity": "", "budget_fraction": "b", "budget_bytes": "budget",
    "cost": "cost", "every": "every", "max_group": "max_group", "profile_batch": "profile_batch",
    "partitions": "K", "kappa": "kappa", "right_input": "input", "noise": "noise",
    "epochs_per_partition": "epochs", "recovery_epochs": "recovery", "parallel": "parallel",
    "prefetch": "prefetch", "pin_memory": "pinned", "min_bytes": "min_bytes",
}


def _of(kind: str, writer: str, *rows: tuple) -> tuple[Column, ...]:
    """The columns of one kind one part writes: (name, unit, meaning[, label, axis, labels])."""
    return tuple(Column(r[0], r[1], kind, writer, r[2], *r[3:]) for r in rows)


_BREAKDOWN = "{" + ",".join(BREAKDOWN) + "}"
COLUMNS: tuple[Column, ...] = (
    # ---- identity and config (loader.identity: the runner and the launchers' lost-job rows)
    *_of("identity", "loader.identity",
         (RUN_ID, "text", "hash of the resolved config, options that only drive a run left out "
                          "(record.py)"),
         *((g, "text", f"the option of conf/{g}/ this run chose (\"\" when none)")
           for g in _IDENTITY_GROUPS)),
    *_of("config", "loader.identity",
         ("method.<option>", "option", "an option of the chosen conf/method/*.yaml; a stack "
                                       "member's as `method.<member>.<option>`", "", "",
          OPTION_LABELS),
         *((f"{g}.<option>", "option", f"an option of the chosen conf/{g}/*.yaml (lists as JSON "
                                       f"text)") for g in CONFIG_GROUPS if g != "method")),
    # ---- status
    *_of("status", "runner",
         (STATUS, "text", "ok, oom, diverged, error or interrupted (running while the job runs)"),
         (ERROR, "text", "why the run did not end ok: the exception or the failure's message"),
         ("failed_step", "count", "the step at which training failed or stopped"),
         ("signal", "text", "the signal that stopped an interrupted run"),
         ("memory_snapshot", "path", "the CUDA memory snapshot (`trainer.memory_snapshot=true`)"),
         ("memory_timeline", "path", "the accounting step's memory timeline, relative to the run "
                                     "folder (`trainer.memory_timeline=true`; timeline.png/.pdf "
                                     "beside it)"),
         ("saved_by_module", "path", "the accounting step's saved-activation bytes per module, "
                                     "relative to the run folder (`trainer.memory_timeline=true`;"
                                     " memtrain/memory/by_module.py)"),
         ("plan_table", "path", "the plan the method applied, one row per segment (checkpoint; "
                                "`trainer.memory_timeline=true`; memtrain/memory/by_module.py)")),
    *_of("status", "runner",
         ("failed_rank", "count", "a run of several ranks that failed: the rank whose failure "
                                  "came first (the row's status and error are its)")),
    *_of("status", "train",
         ("resumed_at_step", "count", "the step a resumed run continued from (`trainer.resume`)")),
    *_of("status", "resume",
         ("resumed_from", "path", "the checkpoint a resumed run continued from"),
         ("resume_warning", "text", "an unreadable checkpoint that was ignored, and why")),
    *_of("status", "checkpoint.prepare",
         ("dry_run", "bool", "`method.dry_run=true`: planned only, not trained")),
    # ---- provenance (provenance.of_run)
    *_of("provenance", "provenance",
         ("device", "text", "the torch device the run used (cpu, cuda:0)"),
         ("device_name", "text", "the GPU's name, or the CPU's"),
         ("device_capability", "text", "the GPU's compute capability"),
         ("device_total_memory_bytes", "bytes", "the GPU's memory (0 on the CPU)"),
         ("cpu_threads", "count", "torch's CPU threads"),
         *((f"{k}_version", "text", f"{k} version")
           for k in ("torch", "cuda", "cudnn", "triton", "python")),
         ("git_commit", "text", "memtrain's commit (`-dirty`: with uncommitted changes)"),
         ("hostname", "text", "the machine"),
         ("slurm_job_id", "text", "the SLURM job, if any")),
    *_of("provenance", "record",
         (SCHEMA, "count", "what the row's columns mean: memtrain/columns.py's SCHEMA_VERSION "
                           "when it was written (none: 1, before versions were recorded)",
          "schema")),
    # ---- the run
    *_of("run", "runner",
         ("num_classes", "count", "classes of the dataset (a language model's: its "
                                  "vocabulary)"),
         ("input_shape", "text", "one sample's shape, e.g. 3x32x32 (tokens: the sequence "
                                 "length)"),
         ("task", "text", "classify, or lm: next-token prediction"),
         ("metric", "text", "the column that holds the run's quality: test_acc, or a language "
                            "model's test_loss"),
         ("metric_higher_better", "bool", "whether a higher `metric` is better"),
         ("data_hash", "text", "the corpus' content hash, where its content can vary "
                               "(dataset=text: the Python version's standard library)"),
         ("data_source", "text", "where the corpus came from"),
         ("params", "count", "parameters of the model"),
         ("grads_exact", "bool", "true: training computes plain training's gradients (none, "
                                 "checkpoint, offload); false: approximate ones (pool, prune, "
                                 "quantize) or other targets (synthetic); a stack's is false "
                                 "where a member's is; as the method declares it "
                                 "(methods/base.py; absent where it does not)", "exact grads"),
         ("world_size", "count", "ranks of a run under `trainer.strategy=ddp|fsdp` (as "
                                 "launched; an estimate's `trainer.world_size`)", "ranks"),
         ("local_batch_size", "count", "samples per rank and step: `trainer.batch_size` (the "
                                       "global batch) / `world_size`", "local batch"),
         ("wall_s", "s", "time of the whole job"),
         (RUN_DIR, "path", "where the run's folder was written"),
         ("finished_at", "time", "when the row was written")),
    *_of("run", "train; checkpoint.prepare (0 on a dry run)",
         ("steps", "count", "training steps done (every phase's, for synthetic)")),
    *_of("run", "train",
         ("warmup_steps_used", "count",
          "warm-up steps (excluded from time and peak; fewer in a short run)"),
         ("epochs_done", "count", "epochs trained"),
         ("train_time_s", "s", "time in the training loop")),
    # ---- memory (measure.py)
    *_of("memory", "measure",
         (PEAK, "bytes", "peak memory over the measured steps: CUDA's `max_memory_allocated`, or "
                         "on the CPU the allocator's own peak of the accounting step, every "
                         "allocation, kernels' scratch included (`mem_peak_source`)", "peak",
          "peak memory"),
         (RESERVED, "bytes", "CUDA's `max_memory_reserved` (none on the CPU)", "reserved"),
         (PEAK_SOURCE, "text", "where the peak comes from: cuda, allocator (the CPU allocator's "
                               "events, torch's profiler) or tracker (the live-tensor tracker: "
                               "where those events could not be had, `mem_peak_note`, and rows "
                               "of schema 1)", "peak source"),
         ("mem_peak_note", "text", "why a CPU peak is the tracker's, not the allocator's"),
         (SAVED, "bytes", "bytes saved for backward in one step, once per storage; tensors alive "
                          "before the step (parameters, buffers, the batch, the targets) "
                          "excluded", "saved act.", "saved activations"),
         ("mem_act_saved_tensors", "count", "tensors saved for backward"),
         ("mem_act_saved_host_bytes", "bytes",
          "saved bytes in host memory on a GPU run (offload); present when not 0"),
         ("mem_resident_other_bytes", "bytes",
          "parameters and buffers on the run's device beside the trained module's (synthetic: "
          "the partitions not in training, all of them on a CPU), in the peak; present when not "
          "0"),
         (ACT_PEAK, "bytes", "the highest activation memory in a step, recomputed activations "
                             "included, backward temporaries not (what the checkpoint planner "
                             "models)", "act. peak", "activation memory"),
         (ACT_TEMP_PEAK, "bytes", "the highest activations + backward temporaries alive at one "
                                  "moment of a step (activation gradients, quantize's "
                                  "dequantized copies, pool's upsampled maps; on the CPU, "
                                  "source allocator, kernels' scratch too): the report's "
                                  "activation ratios", "act.+temp. peak",
          "activation + backward temporary memory"),
         ("mem_tracker_peak_bytes", "bytes", "the live-tensor tracker's peak of the accounting "
                                             "step (no kernel scratch)"),
         ("mem_tracker_act_temp_bytes", "bytes", "the live-tensor tracker's peak of activations "
                                                 "+ backward temporaries (no kernel scratch: "
                                                 "what the estimate predicts)"),
         ("mem_scratch_peak_bytes", "bytes", "CPU, source allocator: the most bytes alive at "
                                             "one moment of the accounting step in allocations "
                                             "that hold no tensor (kernels' scratch: "
                                             "convolution, batch norm; it grows with "
                                             "`cpu_threads`)", "scratch peak"),
         ("mem_rng_state_bytes", "bytes", "the most bytes of RNG state copies alive at one "
                                          "moment of the accounting step (checkpoint keeps one "
                                          "per recomputed group, and one more while it "
                                          "recomputes): host tensors, on the CPU in the peak "
                                          "(as other), on CUDA in no GPU column; present when "
                                          "not 0", "RNG states"),
         ("mem_timeline_peak_bytes", "bytes", "the highest total of the memory timeline "
                                              "(`trainer.memory_timeline`): on the CPU the "
                                              "tracker's peak, on CUDA the allocator history's"),
         ("mem_timeline_source", "text", "what the timeline's events are: `tracker` (the "
                                         "live-tensor tracker, after every op: the CPU) or "
                                         "`cuda` (torch's CUDA allocator history, every "
                                         "allocation and free)"),
         ("mem_timeline_step", "text", "the step the timeline recorded: `accounting`, the step "
                                       "the memory columns measure, which trains like every "
                                       "step and which no timed step includes (recording "
                                       "slows no step of `step_time_s_median`)"),
         ("mem_timeline_alloc_peak_bytes", "bytes", "CUDA: `torch.cuda.max_memory_allocated` "
                                                    "over the recorded step (the timeline's "
                                                    "peak counts requested sizes in 512-byte "
                                                    "blocks)"),
         ("mem_timeline_note", "text", "why the timeline is the tracker's on CUDA (the "
                                       "allocator history did not hold the whole step)"),
         ("mem_accounting_step_s", "s", "the accounting step's wall time, its tracker (and "
                                        "`trainer.memory_timeline`'s recording) included"),
         ("mem_timeline_peak_phase", "text", "the step's phase at the timeline's peak (forward, "
                                             "backward, optimizer)"),
         ("mem_timeline_peak_module", "text", "the innermost module active at the timeline's "
                                              "peak"),
         ("mem_timeline_events", "count", "the timeline's events (one per op of the accounting "
                                          "step; on CUDA one per allocation or free)"),
         ("mem_params_bytes", "bytes", "parameters"),
         ("mem_buffers_bytes", "bytes", "buffers"),
         ("mem_grads_bytes", "bytes", "gradients"),
         ("mem_optim_bytes", "bytes", "optimizer state"),
         (f"mem_at_peak_{_BREAKDOWN}_bytes", "bytes",
          "the breakdown at the moment of the peak (optim: optimizer state); with the update's "
          "temporaries and the CPU's scratch below, adds up to the peak", "", "",
          {"params": "params", "grads": "grads", "optim": "optimizer", "act": "activations",
           "other": "other"}),
         ("mem_at_peak_update_bytes", "bytes",
          "the update's temporaries at the moment of the peak: tensors the optimizer step makes "
          "and frees (SGD's weight-decay and Nesterov copies of a gradient)", "update temp."),
         ("mem_at_peak_scratch_bytes", "bytes",
          "CPU, source allocator: allocations at the moment of the peak that hold no tensor "
          "(kernels' scratch)", "scratch"),
         (f"mem_at_act_peak_{_BREAKDOWN}_bytes", "bytes",
          "the breakdown at the moment of the activation peak (other: buffers, the batch, "
          "backward and update temporaries): where methods differ", "", "",
          {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
           "act": "activations", "other": "other"})),
    *_of("memory", "measure",
         ("mem_comm_buffers_bytes", "bytes",
          "`trainer.strategy=ddp`: DDP's gradient buckets, held from the wrap on beside every "
          "step's tensors (in the peak, as other memory)")),
    *_of("memory", "train",
         ("mem_peak_rss_bytes", "bytes", "peak resident memory of the process")),
    *_of("memory", "distributed",
         ("mem_peak_rank", "count", "a run of several ranks: the rank with the highest "
                                    "`mem_peak_alloc_bytes`, whose figures the row's memory "
                                    "columns are (so its breakdown adds up)", "peak rank"),
         ("rank_max.<column>", "as <column>", "a run of several ranks: the column's largest "
                                              "value over the ranks"),
         ("rank_mean.<column>", "as <column>", "a run of several ranks: the column's mean over "
                                               "the ranks")),
    # ---- speed
    *_of("speed", "measure",
         (STEP_TIME, "s", "median time of a timed step"),
         (STEP_TIME_P90, "s", "90th percentile of a timed step's time"),
         (THROUGHPUT, "samples/s", "batch size / median step time", "samples/s")),
    # ---- accuracy
    *_of("accuracy", "train; runner (empty when never evaluated)",
         (TEST_ACC, "fraction", "top-1 accuracy on the test split", "test acc"),
         ("test_acc5", "fraction", "top-5 accuracy on the test split")),
    *_of("accuracy", "train",
         ("test_loss", "loss", "loss on the test split (language models: per token, the "
                               "validation loss)", "validation loss"),
         ("train_loss", "loss", "the last training loss")),
    *_of("accuracy", "learned",
         ("chance_acc", "fraction", "the accuracy of guessing: 1 / the dataset's classes",
          "chance"),
         ("test_samples", "count", "test samples the accuracy was measured on"),
         ("learned", "bool", "test accuracy above chance by 2 binomial sigma and the last "
                             "training loss below ln(classes) (language models: validation "
                             "loss below `unigram_loss`); false: the run did not learn"),
         ("not_learned_why", "text", "why `learned` is false")),
    *_of("accuracy", "runner",
         ("unigram_loss", "loss", "language models: the validation loss of the training "
                                  "tokens' unigram distribution (a model that ignores context)",
          "unigram loss")),
    *_of("accuracy", "learned",
         ("test_ppl", "perplexity", "language models: exp(test_loss)", "perplexity")),
    # ---- probes
    *_of("probe", "estimate",
         (ESTIMATE, "bytes", "predicted peak of one step (fake tensors; predicts "
                             "`mem_tracker_peak_bytes`: no kernel scratch)", "estimate"),
         (ESTIMATE_ACT, "bytes", "predicted activation peak (predicts `mem_peak_act_bytes`)"),
         (ESTIMATE_ACT_TEMP, "bytes", "predicted activations + backward temporaries peak "
                                      "(predicts `mem_tracker_act_temp_bytes`: no kernel "
                                      "scratch)"),
         ("mem_estimate_saved_bytes", "bytes",
          "predicted saved bytes (predicts `mem_act_saved_bytes`)"),
         ("mem_estimate_at_peak_{" + ",".join(ESTIMATE_AT_PEAK) + "}_bytes", "bytes",
          "the predicted breakdown at the peak (optim: optimizer state; update: the update's "
          "temporaries)"),
         (f"mem_estimate_at_act_peak_{_BREAKDOWN}_bytes", "bytes",
          "the predicted breakdown at the activation peak"),
         ("mem_estimate_device", "text", "the device the estimate modelled"),
         ("mem_estimate_phase", "text",
          "a multi-phase method's phase with the largest predicted peak"),
         ("mem_estimate_act_phase", "text",
          "the phase with the largest predicted activation peak")),
    *_of("probe", "probes",
         ("mem_estimate_error", "text", "why the estimate failed (training went on)"),
         (MAX_BATCH, "count", "`trainer.find_max_batch`: the largest batch whose peak + the "
                              "CUDA context fits in (1 - `trainer.max_batch_headroom`) x the cap "
                              "(`trainer.gpu_memory_gb`, else the GPU's memory), rounded down to "
                              "`trainer.max_batch_multiple`", "largest batch"),
         ("max_batch_budget_bytes", "bytes", "`trainer.find_max_batch`: what a batch's peak "
                                             "could take: (1 - headroom) x cap - the context"),
         ("max_batch_context_bytes", "bytes", "`trainer.find_max_batch`: the CUDA context "
                                              "counted against the cap (the largest measured)"),
         ("max_batch_context_source", "text", "where that context came from: set "
                                              "(`trainer.cuda_context_gb`), measured (CUDA) or "
                                              "assumed (the CPU: docs/estimate.md)")),
    *_of("probe", "capacity",
         ("gpu_memory_cap_bytes", "bytes", "`trainer.gpu_memory_gb` in bytes"),
         ("gpu_memory_cap_applied", "bool", "whether the cap was applied (CUDA only)")),
    # ---- method checkpoint (CheckpointMethod.prepare: its plan)
    *_of("method", "checkpoint.prepare",
         ("plan_peak_bytes", "bytes", "the planner's modelled activation peak"),
         ("plan_baseline_peak_bytes", "bytes", "the modelled activation peak without "
                                               "recomputation"),
         ("plan_budget_bytes", "bytes", "the budget asked for (`method.budget_fraction` of "
                                        "the baseline's peak, or `method.budget_bytes`)"),
         ("plan_budget_raised_to_bytes", "bytes",
          "a budget below the smallest feasible activation peak is raised to it (a warning): "
          "the peak planned for instead (a stack: the least measured)"),
         ("plan_measured_peak_bytes", "bytes",
          "a stack's plan, measured in one tracked step before training"),
         ("plan_overhead", "ratio", "predicted extra step time: profiled forward time of the "
                                    "recomputed segments / forward-backward time (no fixed "
                                    "costs of checkpointing)"),
         ("plan_measured_overhead", "ratio", "the plan's extra forward-backward time, measured "
                                             "before training (median of alternating passes "
                                             "with and without it on the profile batch)"),
         ("plan_overhead_error", "ratio", "`plan_overhead` - `plan_measured_overhead`"),
         ("plan_recompute_s", "s", "modelled recompute time"),
         ("plan_solve_s", "s", "the solver's time"),
         ("plan_segments", "count", "segments of the model's chain"),
         ("plan_groups", "text", "recomputed groups of segments, `a-e;...`"),
         ("plan_granularity", "text", "op or block: what was planned"),
         ("plan_kept_ops", "count", "op plans: ops kept inside recomputed groups"),
         ("plan_recomputed_ops", "count", "op plans: ops recomputed"),
         ("plan_compact_segments", "count", "op plans: kept segments stored compacted"),
         ("plan_compact_bytes", "bytes", "op plans: bytes the compaction saves")),
    # ---- method prune (PruneMethod.prepare: its plan)
    *_of("method", "prune.prepare",
         ("prune_layer_calls", "count", "layer calls whose saved input the plan prunes"),
         ("prune_relu_masked", "count",
          "ReLU calls that keep a 1-bit mask instead of the output pruned after them")),
    # ---- method synthetic (Synthetic.fit: one training phase per partition)
    *_of("method", "synthetic.fit",
         ("part<j>.<column>", "as <column>", "partition j's phase's own value of a column"),
         ("recovery.<column>", "as <column>",
          "the end-to-end recovery phase's own value of a column"),
         ("part<j>.units", "text", "partition j's units, `first-last`"),
         ("part<j>.mem_labels_bytes", "bytes", "the label matrices partition j holds"),
         ("synthetic_cuts", "text", "the cuts, unit indices `a;b`"),
         ("synthetic_largest_phase", "text", "the phase whose peak the row's memory columns "
                                             "report"),
         ("synthetic_largest_act_phase", "text",
          "the phase whose activation peak the row's activation columns report")),
)

# <column> is a declared column, never another phase's copy (part0.part1.steps)
_PLACEHOLDERS = {"<option>": r"(?P<option>[^.\s][^\s]*)", "<j>": r"\d+",
                 "<column>": r"(?!part\d+\.|recovery\.|rank_m)(?P<column>[^\s]+)"}


def _regex(name: str) -> re.Pattern:
    out, i = "", 0
    for m in re.finditer(r"<\w+>|\{[^}]*\}", name):
        out += re.escape(name[i:m.start()])
        tok = m.group(0)
        out += _PLACEHOLDERS[tok] if tok.startswith("<") else \
            "(?P<word>" + "|".join(map(re.escape, tok[1:-1].split(","))) + ")"
        i = m.end()
    return re.compile(out + re.escape(name[i:]) + r"\Z")


_EXACT = {c.name: c for c in COLUMNS if not c.family}
_FAMILIES = [(c, _regex(c.name)) for c in COLUMNS if c.family]


@functools.lru_cache(maxsize=4096)
def _match(name: str) -> tuple[Column, str] | None:
    """(the declaration, the option or word a family's member stands for) or None."""
    if name in _EXACT:
        return _EXACT[name], ""
    for col, rx in _FAMILIES:
        m = rx.match(name)
        if m is None:
            continue
        part = m.groupdict()
        if "column" in part:  # a phase's copy of a declared column
            inner = _match(part["column"])
            if inner is None:
                continue
            return inner
        return col, part.get("option") or part.get("word") or ""
    return None


def lookup(name: str) -> Column | None:
    """The declaration of a column (a phase's copy resolves to the column it copies)."""
    found = _match(name)
    return found[0] if found else None


def declared(name: str) -> bool:
    return isinstance(name, str) and _match(name) is not None


def undeclared(row: Mapping | Iterable[str]) -> list[str]:
    """The columns of a row (or names) that no declaration covers."""
    return [k for k in row if not declared(k)]


def label(name: str) -> str:
    """A column's short name: its own, its family's for its option or word, else the name
    (`method.<option>` without its label: the option itself)."""
    found = _match(name)
    if found is None:
        return name
    col, part = found
    if col.name.endswith("<option>"):  # an option by its own (last) name, or its short one
        leaf = part.rpartition(".")[2]
        return col.labels.get(leaf, leaf)
    return col.labels.get(part) or col.label or name


def axis(name: str) -> str:
    """A figure axis's name of a column: its `axis`, else its label."""
    col = lookup(name)
    return (col.axis if col is not None and col.axis else "") or label(name)


def unit(name: str) -> str | None:
    col = lookup(name)
    return None if col is None else col.unit


# Units whose values cannot leave a range, whatever the column: an accuracy of 7.5, a negative
# byte count or a negative throughput is no measurement (a row edited by hand, another tool's).
RANGES = {"fraction": (0.0, 1.0), "bytes": (0.0, None), "s": (0.0, None),
          "samples/s": (0.0, None), "count": (0.0, None), "perplexity": (1.0, None)}
# ... except differences, which may be negative by design: what the allocator holds beyond the
# tracked parts ("other" of a CUDA breakdown is not clamped: the tracker seeing more must show)
SIGNED = re.compile(r"_other_bytes$|_error|_delta|_diff")


def valid_range(name: str) -> tuple[float, float | None] | None:
    """(lo, hi) a value of the column must lie in (hi None: no upper end), or None."""
    u = unit(name)
    if u not in RANGES or SIGNED.search(name):
        return None
    return RANGES[u]


def labels_of(family: str) -> dict[str, str]:
    """A family's labels by option or word, e.g. labels_of('method.<option>')."""
    return dict(next(c.labels for c in COLUMNS if c.name == family))


# ---------------------------------------------------------------- the report's ratios


@dataclass(frozen=True)
class Ratio:
    """A column the report adds to each run (report.tables.add_baselines): the run's `of` over
    its baseline's, the `none` run of the same model, seed and settings (1 = equal)."""

    name: str  # the report's column
    of: str  # the column divided
    meaning: str  # a few words: what `of` is
    short: str = ""  # its name in headings ("" = label(of))

    @property
    def label(self) -> str:
        return self.short or label(self.of)

    def heading(self, baseline: str = "none") -> str:
        """A table's heading: 'peak / none'."""
        return f"{self.label} / {baseline}"

    def axis(self, baseline: str = "none") -> str:
        """A figure axis's name, one line, naming the exact column: 'peak / none
        (mem_peak_alloc_bytes)'."""
        return f"{self.heading(baseline)} ({self.of})"

    def over(self, baseline: str = "none") -> str:
        """'`mem_peak_alloc_bytes` over none's, the step's total peak (...)'."""
        return f"`{self.of}` over {baseline}'s, {self.meaning}"

    def definition(self, baseline: str = "none") -> str:
        """'`peak / none`: `mem_peak_alloc_bytes` over none's, the step's total peak (...)'."""
        return f"`{self.heading(baseline)}`: {self.over(baseline)}"


# The one memory ratio a reader quotes: the step's total peak against none's. Every figure's
# main memory axis, the terminal table and report.md's first table show it; the other memory
# ratios are labelled detail.
HEADLINE = Ratio("mem_peak_rel", PEAK,
                 "the step's total peak (CUDA: the allocated peak, which decides whether a run "
                 "fits, the reserved one beside it; the CPU: the accounting step's peak)")
MEMORY_DETAIL = (
    Ratio("mem_reserved_rel", RESERVED, "CUDA's reserved peak (the allocated peak and the "
                                        "caching allocator's free blocks)"),
    Ratio("mem_act_temp_rel", ACT_TEMP_PEAK, "activations and backward temporaries alive at "
                                             "one moment, at their peak"),
    Ratio("mem_act_rel", ACT_PEAK, "activations alone at their peak, recomputed ones included "
                                   "(what the checkpoint planner models)"),
    Ratio("mem_saved_rel", SAVED, "bytes saved for backward (under recomputation they "
                                  "undercount)"),
)
OTHER_RATIOS = (
    Ratio("throughput_rel", "throughput_e2e_samples_s", "training samples per second, end to "
                                                       "end", "throughput"),
    Ratio("step_time_rel", "step_time_e2e_s", "the median step time, end to end", "step time"),
    Ratio("mem_estimate_rel", ESTIMATE, "the GPU-free estimate's peak", "predicted peak"),
    Ratio("mem_estimate_act_rel", ESTIMATE_ACT, "the estimate's activation peak",
          "predicted act. peak"),
    Ratio("mem_estimate_saved_rel", "mem_estimate_saved_bytes", "the estimate's saved bytes",
          "predicted saved act."),
)
RATIOS = (HEADLINE, *MEMORY_DETAIL, *OTHER_RATIOS)
BASELINE_RULE = "a run's value over its baseline's: the none run of the same model, seed and " \
                "settings"


def ratio(name: str) -> Ratio | None:
    """The ratio the report's column `name` holds (`mem_peak_rel`), or None."""
    return next((r for r in RATIOS if r.name == name), None)


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") == "1"


class UndeclaredColumn(ValueError):
    """A row holds a column memtrain/columns.py does not declare (MEMTRAIN_STRICT_COLUMNS=1)."""


def check(row: Mapping, where: str = "") -> list[str]:
    """Undeclared columns of a row about to be written: a warning (the row is written all the
    same: a user's run must not die of it), an error under MEMTRAIN_STRICT_COLUMNS=1."""
    bad = undeclared(row)
    if bad:
        msg = (f"undeclared column{'s' * (len(bad) > 1)} {', '.join(map(repr, bad))}"
               f"{f' in {where}' if where else ''}: declare {'them' if len(bad) > 1 else 'it'} "
               f"in memtrain/columns.py")
        if strict():
            raise UndeclaredColumn(msg)
        log.warning(msg)
    return bad


# ---------------------------------------------------------------- the outputs page's table


def markdown() -> str:
    """The table of every column, grouped by kind, as docs/outputs.md shows it."""
    lines = ["| column | unit | written by | meaning |", "| --- | --- | --- | --- |"]
    for kind, what in KINDS.items():
        lines.append(f"| **{kind}** | | | {what} |")
        for c in COLUMNS:
            if c.kind == kind:
                lines.append(f"| `{c.name}` | {c.unit} | {c.writer} | {c.meaning} |")
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (docs/outputs.md) with the table between its markers replaced by the current
    one."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtrain.columns", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print the table")
    ap.add_argument("--write", type=Path, metavar="PAGE",
                    help="replace the table between the file's markers")
    a = ap.parse_args(argv)
    if a.write:
        a.write.write_text(with_table(a.write.read_text(encoding="utf-8")), encoding="utf-8")
    if a.markdown or not a.write:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
