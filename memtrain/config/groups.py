"""The config groups a user chooses from, read from conf/: `memtrain --help` and the usage page's
group table (docs/usage.md) are generated here, so neither goes stale when an option (a YAML
file) is added.

    python -m memtrain.config.groups --markdown             # the table
    python -m memtrain.config.groups --write docs/usage.md  # between the page's group markers

A group's options are its folder's YAML files (schemas `base_*` left out), its default the one
conf/config.yaml's defaults list chooses. Imports the standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from memtrain.paths import conf_dir

# the groups a user chooses, in the order a reader needs them, with one line each; conf/report
# holds display settings of the report (no run composes it) and is no group to choose
GROUPS = {
    "method": "the memory-saving method (a stack such as checkpoint+quantize is one option)",
    "model": "the network; channels, image size and classes come from the data",
    "dataset": "the data; synthetic needs no files",
    "optim": "the optimizer and its learning-rate schedule",
    "trainer": "how long and how to train and measure (every option: memtrain --cfg job -p "
               "trainer)",
    "experiment": "a preset study: a sweep over groups and options",
    "recipe": "chosen for you: conf/recipe/<model>_<optim>.yaml adjusts a model's optimizer where "
              "the shared default does not train it; command-line values still win",
}
BEGIN, END = "<!-- groups:begin (python -m memtrain.config.groups --write docs/usage.md) -->", \
    "<!-- groups:end -->"
EXAMPLES = (
    ("memtrain method=pool model=resnet50", "one run: a row of memory, speed and accuracy"),
    ("memtrain -m method=none,checkpoint,quantize model=mlp6 dataset=fashion_mnist",
     "a sweep: one job per method, a report in the sweep folder"),
    ("memtrain model=resnet50 trainer.estimate=true trainer.max_steps=0",
     "the GPU-free estimate of one step's peak, no GPU and no data needed"),
    ("memtrain experiment=quick", "the study behind `make run` (CPU, minutes)"),
    ("memtrain-report runs/multirun/DATE/TIME", "tables and figures from run folders"),
)


def options(group: str, conf: Path | None = None) -> list[str]:
    folder = (conf or conf_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("base_"))


def defaults(conf: Path | None = None) -> dict[str, str]:
    """group -> the option conf/config.yaml's defaults list chooses."""
    text = ((conf or conf_dir()) / "config.yaml").read_text(encoding="utf-8")
    return {m[1]: m[2] for m in re.finditer(r"^\s*-\s*(\w+):\s*([\w+]+)\s*$", text, re.M)
            if m[2] != "null"}


def markdown(conf: Path | None = None) -> str:
    chosen = defaults(conf)
    rows = ["| group | what it chooses | options (default first) |", "| --- | --- | --- |"]
    for group, what in GROUPS.items():
        opts = options(group, conf)
        first = chosen.get(group)
        ordered = ([first] if first in opts else []) + [o for o in opts if o != first]
        rows.append(f"| `{group}` | {what} | " + ", ".join(f"`{o}`" for o in ordered) + " |")
    return "\n".join(rows)


def help_text(conf: Path | None = None) -> str:
    """`memtrain --help`: what memtrain is, its groups with their options, examples."""
    chosen = defaults(conf)
    out = ["memtrain: how much memory does a training run need, and what does each "
           "memory-saving method cost in accuracy and speed? One run = one row (peak memory "
           "with a breakdown, throughput, accuracy).", "",
           "Usage:  memtrain [group=option ...] [key=value ...]     one run",
           "        memtrain -m group=a,b key=x,y ...              a sweep", "",
           "Groups (group=option):"]
    for group, what in GROUPS.items():
        opts = options(group, conf)
        first = chosen.get(group)
        listed = ", ".join(f"{o}*" if o == first else o for o in opts)
        out += [f"  {group:<11}{what}", f"  {'':<11}{listed}"]
    out += ["  (* the default)", "", "Examples:"]
    out += [f"  {cmd}\n      {what}" for cmd, what in EXAMPLES]
    out += ["", "More: every option of a run: memtrain --cfg job (one group: -p method); "
            "Hydra's own flags: memtrain --hydra-help; docs/usage.md."]
    return "\n".join(out)


def with_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + markdown() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtrain.config.groups")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--write", metavar="PAGE")
    args = ap.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown() if args.markdown else help_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
