"""Every column a run's row (summary.json) can hold, declared once: its unit, its kind, what it
means, which part of memtrain writes it, and how the report labels it.

    python -m memtrain.columns --markdown        # the table (README.md's "Outputs")
    python -m memtrain.columns --write README.md # put it between README's column markers

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
BEGIN, END = "<!-- columns:begin (python -m memtrain.columns --write README.md) -->", \
    "<!-- columns:end -->"

UNITS = {
    "bytes": "bytes", "s": "seconds", "samples/s": "training samples per second",
    "fraction": "a number in [0, 1] (accuracy: 0.9 = 90%)", "ratio": "a ratio, 1 = equal",
    "count": "a whole number", "bool": "true or false", "text": "text", "path": "a folder or file",
    "time": "a UTC ISO 8601 time", "loss": "a loss value", "option": "as written in conf/",
}
# in the order the README lists them
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
ESTIMATE_AT_PEAK = ("params", "buffers", "grads", "optim", "act", "other")  # the tracker's own

# the columns the report and the studies read by name
RUN_ID, STATUS, ERROR, METHOD, RUN_DIR = "run_id", "status", "error", "method", "run_dir"
PEAK, RESERVED, PEAK_SOURCE = "mem_peak_alloc_bytes", "mem_peak_reserved_bytes", "mem_peak_source"
ACT_PEAK, SAVED = "mem_peak_act_bytes", "mem_act_saved_bytes"
THROUGHPUT, STEP_TIME, STEP_TIME_P90 = ("throughput_samples_s", "step_time_s_median",
                                        "step_time_s_p90")
TEST_ACC, MAX_BATCH = "test_acc", "max_batch_size"
ESTIMATE, ESTIMATE_ACT = "mem_estimate_bytes", "mem_estimate_act_bytes"

# method.<option> -> its short name in labels ("" shows the value alone: `pool conv+bn`)
OPTION_LABELS = {
    "kernel_size": "k", "pool_type": "", "mode": "", "targets": "", "relu_mask": "relu",
    "min_size": "min", "compress_input": "input",
    "sparsity": "s", "block_size": "block", "criterion": "", "layers": "", "backend": "",
    "prune_head": "head", "prune_shared": "shared",
    "strategy": "", "granularity": "", "budget_fraction": "b", "budget_bytes": "budget",
    "every": "every", "max_group": "max_group", "profile_batch": "profile_batch",
    "partitions": "K", "kappa": "kappa", "right_input": "input", "noise": "noise",
    "epochs_per_partition": "epochs", "recovery_epochs": "recovery", "parallel": "parallel",
    "prefetch": "prefetch", "pin_memory": "pinned", "min_bytes": "min_bytes",
}


def _c(name: str, unit: str, kind: str, writer: str, meaning: str, **kw) -> Column:
    return Column(name, unit, kind, writer, meaning, **kw)


COLUMNS: tuple[Column, ...] = (
    # ---- identity and config (config.identity: the runner and the launchers' lost-job rows)
    _c(RUN_ID, "text", "identity", "config.identity",
       "hash of the resolved config, options that only drive a run left out (record.py)"),
    *(_c(g, "text", "identity", "config.identity",
         f"the option of conf/{g}/ this run chose (\"\" when none)") for g in _IDENTITY_GROUPS),
    _c("method.<option>", "option", "config", "config.identity",
       "an option of the chosen conf/method/*.yaml; a stack member's as "
       "`method.<member>.<option>`", labels=OPTION_LABELS),
    *(_c(f"{g}.<option>", "option", "config", "config.identity",
         f"an option of the chosen conf/{g}/*.yaml (lists as JSON text)")
      for g in CONFIG_GROUPS if g != "method"),
    # ---- status
    _c(STATUS, "text", "status", "runner",
       "ok, oom, diverged, error or interrupted (running while the job runs)"),
    _c(ERROR, "text", "status", "runner",
       "why the run did not end ok: the exception or the failure's message"),
    _c("failed_step", "count", "status", "runner", "the step at which training failed or stopped"),
    _c("signal", "text", "status", "runner", "the signal that stopped an interrupted run"),
    _c("resumed_at_step", "count", "status", "train",
       "the step a resumed run continued from (`trainer.resume`)"),
    _c("resumed_from", "path", "status", "resume", "the checkpoint a resumed run continued from"),
    _c("resume_warning", "text", "status", "resume",
       "an unreadable checkpoint that was ignored, and why"),
    _c("dry_run", "bool", "status", "checkpoint.prepare",
       "`method.dry_run=true`: planned only, not trained"),
    _c("memory_snapshot", "path", "status", "runner",
       "the CUDA memory snapshot (`trainer.memory_snapshot=true`)"),
    # ---- provenance (measure.provenance)
    _c("device", "text", "provenance", "measure", "the torch device the run used (cpu, cuda:0)"),
    _c("device_name", "text", "provenance", "measure", "the GPU's name, or the CPU's"),
    _c("device_capability", "text", "provenance", "measure", "the GPU's compute capability"),
    _c("device_total_memory_bytes", "bytes", "provenance", "measure",
       "the GPU's memory (0 on the CPU)"),
    _c("cpu_threads", "count", "provenance", "measure", "torch's CPU threads"),
    *(_c(f"{k}_version", "text", "provenance", "measure", f"{k} version")
      for k in ("torch", "cuda", "cudnn", "triton", "python")),
    _c("git_commit", "text", "provenance", "measure",
       "memtrain's commit (`-dirty`: with uncommitted changes)"),
    _c("hostname", "text", "provenance", "measure", "the machine"),
    _c("slurm_job_id", "text", "provenance", "measure", "the SLURM job, if any"),
    # ---- the run
    _c("num_classes", "count", "run", "runner", "classes of the dataset"),
    _c("input_shape", "text", "run", "runner", "one sample's shape, e.g. 3x32x32"),
    _c("params", "count", "run", "runner", "parameters of the model"),
    _c("steps", "count", "run", "train", "training steps done (every phase's, for synthetic)"),
    _c("warmup_steps_used", "count", "run", "train",
       "warm-up steps (excluded from time and peak; fewer in a short run)"),
    _c("epochs_done", "count", "run", "train", "epochs trained"),
    _c("train_time_s", "s", "run", "train", "time in the training loop"),
    _c("wall_s", "s", "run", "runner", "time of the whole job"),
    _c(RUN_DIR, "path", "run", "runner", "where the run's folder was written"),
    _c("finished_at", "time", "run", "runner", "when the row was written"),
    # ---- memory (measure.py)
    _c(PEAK, "bytes", "memory", "measure",
       "peak memory over the measured steps: CUDA's `max_memory_allocated`, or on the CPU the "
       "live-tensor tracker's peak (`mem_peak_source`)", label="peak", axis="peak memory"),
    _c(RESERVED, "bytes", "memory", "measure", "CUDA's `max_memory_reserved` (none on the CPU)",
       label="reserved"),
    _c(PEAK_SOURCE, "text", "memory", "measure",
       "where the peak comes from: cuda or tracker", label="peak source"),
    _c(SAVED, "bytes", "memory", "measure",
       "bytes saved for backward in one step, once per storage; tensors alive before the step "
       "(parameters, buffers, the batch, the targets) excluded", label="saved act.",
       axis="saved activations"),
    _c("mem_act_saved_tensors", "count", "memory", "measure", "tensors saved for backward"),
    _c("mem_act_saved_host_bytes", "bytes", "memory", "measure",
       "saved bytes in host memory on a GPU run (offload); present when not 0"),
    _c(ACT_PEAK, "bytes", "memory", "measure",
       "the highest activation memory in a step, recomputed activations included",
       label="act. peak", axis="activation memory"),
    _c("mem_tracker_peak_bytes", "bytes", "memory", "measure",
       "the live-tensor tracker's peak of the accounting step"),
    _c("mem_params_bytes", "bytes", "memory", "measure", "parameters"),
    _c("mem_buffers_bytes", "bytes", "memory", "measure", "buffers"),
    _c("mem_grads_bytes", "bytes", "memory", "measure", "gradients"),
    _c("mem_optim_bytes", "bytes", "memory", "measure", "optimizer state"),
    _c("mem_at_peak_{" + ",".join(BREAKDOWN) + "}_bytes", "bytes", "memory", "measure",
       "the breakdown at the moment of the peak; adds up to the peak",
       labels={"params": "params", "grads": "grads", "optim": "optimizer",
               "act": "activations", "other": "other"}),
    _c("mem_at_act_peak_{" + ",".join(BREAKDOWN) + "}_bytes", "bytes", "memory", "measure",
       "the breakdown at the moment of the activation peak (other: buffers, the batch, backward "
       "temporaries): where methods differ",
       labels={"params": "parameters", "grads": "gradients", "optim": "optimizer state",
               "act": "activations", "other": "other"}),
    _c("mem_peak_rss_bytes", "bytes", "memory", "train", "peak resident memory of the process"),
    # ---- speed
    _c(STEP_TIME, "s", "speed", "measure", "median time of a timed step"),
    _c(STEP_TIME_P90, "s", "speed", "measure", "90th percentile of a timed step's time"),
    _c(THROUGHPUT, "samples/s", "speed", "measure", "batch size / median step time",
       label="samples/s"),
    # ---- accuracy
    _c(TEST_ACC, "fraction", "accuracy", "train", "top-1 accuracy on the test split",
       label="test acc"),
    _c("test_acc5", "fraction", "accuracy", "train", "top-5 accuracy on the test split"),
    _c("test_loss", "loss", "accuracy", "train", "loss on the test split"),
    _c("train_loss", "loss", "accuracy", "train", "the last training loss"),
    # ---- probes
    _c(ESTIMATE, "bytes", "probe", "estimate",
       "predicted peak of one step (fake tensors; predicts `mem_tracker_peak_bytes`)",
       label="estimate"),
    _c(ESTIMATE_ACT, "bytes", "probe", "estimate",
       "predicted activation peak (predicts `mem_peak_act_bytes`)"),
    _c("mem_estimate_saved_bytes", "bytes", "probe", "estimate",
       "predicted saved bytes (predicts `mem_act_saved_bytes`)"),
    _c("mem_estimate_at_peak_{" + ",".join(ESTIMATE_AT_PEAK) + "}_bytes", "bytes", "probe",
       "estimate", "the predicted breakdown at the peak"),
    _c("mem_estimate_at_act_peak_{" + ",".join(BREAKDOWN) + "}_bytes", "bytes", "probe",
       "estimate", "the predicted breakdown at the activation peak"),
    _c("mem_estimate_device", "text", "probe", "estimate", "the device the estimate modelled"),
    _c("mem_estimate_phase", "text", "probe", "estimate",
       "a multi-phase method's phase with the largest predicted peak"),
    _c("mem_estimate_act_phase", "text", "probe", "estimate",
       "the phase with the largest predicted activation peak"),
    _c("mem_estimate_error", "text", "probe", "probes",
       "why the estimate failed (training went on)"),
    _c(MAX_BATCH, "count", "probe", "probes",
       "`trainer.find_max_batch`: the largest batch that fits (under `trainer.gpu_memory_gb`)",
       label="largest batch"),
    _c("gpu_memory_cap_bytes", "bytes", "probe", "capacity", "`trainer.gpu_memory_gb` in bytes"),
    _c("gpu_memory_cap_applied", "bool", "probe", "capacity",
       "whether the cap was applied (CUDA only)"),
    # ---- method checkpoint (CheckpointMethod.prepare: its plan)
    _c("plan_peak_bytes", "bytes", "method", "checkpoint.prepare",
       "the planner's modelled activation peak"),
    _c("plan_baseline_peak_bytes", "bytes", "method", "checkpoint.prepare",
       "the modelled activation peak without recomputation"),
    _c("plan_budget_bytes", "bytes", "method", "checkpoint.prepare", "the budget planned for"),
    _c("plan_measured_peak_bytes", "bytes", "method", "checkpoint.prepare",
       "a stack's plan, measured in one tracked step before training"),
    _c("plan_overhead", "ratio", "method", "checkpoint.prepare",
       "modelled recompute time / forward-backward time"),
    _c("plan_recompute_s", "s", "method", "checkpoint.prepare", "modelled recompute time"),
    _c("plan_solve_s", "s", "method", "checkpoint.prepare", "the solver's time"),
    _c("plan_segments", "count", "method", "checkpoint.prepare", "segments of the model's chain"),
    _c("plan_groups", "text", "method", "checkpoint.prepare",
       "recomputed groups of segments, `a-e;...`"),
    _c("plan_granularity", "text", "method", "checkpoint.prepare", "op or block: what was planned"),
    _c("plan_kept_ops", "count", "method", "checkpoint.prepare",
       "op plans: ops kept inside recomputed groups"),
    _c("plan_recomputed_ops", "count", "method", "checkpoint.prepare",
       "op plans: ops recomputed"),
    _c("plan_compact_segments", "count", "method", "checkpoint.prepare",
       "op plans: kept segments stored compacted"),
    _c("plan_compact_bytes", "bytes", "method", "checkpoint.prepare",
       "op plans: bytes the compaction saves"),
    # ---- method synthetic (Synthetic.fit: one training phase per partition)
    _c("part<j>.<column>", "as <column>", "method", "synthetic.fit",
       "partition j's phase's own value of a column"),
    _c("recovery.<column>", "as <column>", "method", "synthetic.fit",
       "the end-to-end recovery phase's own value of a column"),
    _c("part<j>.units", "text", "method", "synthetic.fit", "partition j's units, `first-last`"),
    _c("part<j>.mem_labels_bytes", "bytes", "method", "synthetic.fit",
       "the label matrices partition j holds"),
    _c("synthetic_cuts", "text", "method", "synthetic.fit", "the cuts, unit indices `a;b`"),
    _c("synthetic_largest_phase", "text", "method", "synthetic.fit",
       "the phase whose peak the row's memory columns report"),
    _c("synthetic_largest_act_phase", "text", "method", "synthetic.fit",
       "the phase whose activation peak the row's activation columns report"),
)

# <column> is a declared column, never another phase's copy (part0.part1.steps)
_PLACEHOLDERS = {"<option>": r"(?P<option>[^.\s][^\s]*)", "<j>": r"\d+",
                 "<column>": r"(?!part\d+\.|recovery\.)(?P<column>[^\s]+)"}


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


def labels_of(family: str) -> dict[str, str]:
    """A family's labels by option or word, e.g. labels_of('method.<option>')."""
    return dict(next(c.labels for c in COLUMNS if c.name == family))


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


# ---------------------------------------------------------------- the README's table


def markdown() -> str:
    """The table of every column, grouped by kind, as README.md shows it."""
    lines = ["| column | unit | written by | meaning |", "| --- | --- | --- | --- |"]
    for kind, what in KINDS.items():
        lines.append(f"| **{kind}** | | | {what} |")
        for c in COLUMNS:
            if c.kind == kind:
                lines.append(f"| `{c.name}` | {c.unit} | {c.writer} | {c.meaning} |")
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (README.md) with the table between its markers replaced by the current one."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtrain.columns", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print the table")
    ap.add_argument("--write", type=Path, metavar="README.md",
                    help="replace the table between the file's markers")
    a = ap.parse_args(argv)
    if a.write:
        a.write.write_text(with_table(a.write.read_text(encoding="utf-8")), encoding="utf-8")
    if a.markdown or not a.write:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
