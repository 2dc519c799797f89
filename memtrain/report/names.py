"""Display names of the report: short setting labels (`checkpoint b=0.65`, `pool k=2 conv+bn`,
`pool compaction only`; a stack's member options by their own short names,
`checkpoint+quantize b=0.5 bits=4`) and panel titles (`ResNet-18 / CIFAR-10`).

The defaults (conf/report/names.yaml; a method option's short name is the label of its column,
memtrain/columns.py) read well for the built-in methods, models and datasets; a user changes any
of them with a mapping (`memtrain-report --names FILE.yaml`, `--label OLD:NEW`, or the Hydra
callback's `names` option) holding any of these keys:

```yaml
params: {kernel_size: k, targets: ""}   # method parameter -> short name; "" shows the value alone
settings:                               # a setting's own name; first match wins; the parameters
  - {method: pool, kernel_size: 1, name: pool compaction only}   # it names leave the label
  - {method: prune, name: "prune {sparsity} of blocks"}   # {parameter}: its value
labels: {"pool k=2": "Pool (k=2)"}      # a label as drawn -> another
models: {mlp6: MLP-6}
datasets: {fashion_mnist: Fashion-MNIST}
```

Methods are shown in the order of conf/report/methods.yaml, each in its colour there; a method of
conf/method (or of the rows) that is not listed gets a place and a colour all the same
(`method_order`): no list in the code names the methods.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memtrain import columns, paths

# The Hydra groups whose options are flattened into `<group>.<key>` columns (here, the report's
# lowest module, so that tables and screen both read it without importing each other).
CONFIG_PREFIXES = tuple(f"{g}." for g in columns.CONFIG_GROUPS)



class InputError(ValueError):
    """Bad input to the report (an option, folders with no runs): the CLI's exit status 2."""

def _read(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"names: cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"names: {path} is not YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"names: {path} must hold a mapping with keys {', '.join(KEYS)}")
    return data


def conf_file(name: str) -> dict[str, Any]:
    """conf/report/<name>.yaml, a mapping ({} when there is none): display defaults that no run
    composes, so they never enter a run_id."""
    path = paths.conf_dir() / "report" / f"{name}.yaml"
    return _read(path) if path.is_file() else {}


# The defaults, conf/report/names.yaml: parameter (without `method.`) -> short name, from the
# labels of the `method.<option>` columns (memtrain/columns.py; "" shows the value alone: `pool
# conv+bn`), settings with names of their own (first match wins), model and dataset names.
_DEFAULTS = conf_file("names")
PARAMS = {**columns.labels_of("method.<option>"), **(_DEFAULTS.get("params") or {})}
SETTINGS = tuple(_DEFAULTS.get("settings") or ())
MODELS = dict(_DEFAULTS.get("models") or {})
DATASETS = dict(_DEFAULTS.get("datasets") or {})
# A parameter whose meaning depends on another's value: checkpoint's budget_fraction is torch's
# activation_memory_budget under strategy=compile, not the planner's budget.
CONTEXT_PARAMS = {("strategy", "compile", "budget_fraction"): "amb"}
# Parameters a setting does not use, given another's value (left out of its label: a selective
# checkpoint's budget_fraction is the default it never reads, not a budget). Checkpoint's
# planner options apply to strategy=budget alone, `every` to uniform, the op cost to op plans.
_PLANNER = {"budget_bytes", "max_group", "granularity", "cost", "profile_batch",
            "profile_repeats"}
UNUSED_PARAMS: dict[tuple[str, str], set[str]] = {
    ("strategy", "selective"): {"budget_fraction", "every", *_PLANNER},
    ("strategy", "sqrt"): {"budget_fraction", "every", *_PLANNER},
    ("strategy", "uniform"): {"budget_fraction", *_PLANNER},
    ("strategy", "compile"): {"every", *_PLANNER},
    ("strategy", "native"): {"budget_fraction", "every", *_PLANNER},
    ("strategy", "budget"): {"every"},
    ("granularity", "block"): {"cost"},
}
KEYS = ("params", "settings", "labels", "models", "datasets")
# method -> its colour (None: a spare one), in display order (conf/report/methods.yaml)
METHODS: dict[str, str | None] = {str(k): None if v is None else str(v)
                                  for k, v in conf_file("methods").items()}
BASELINE_METHOD = "none"


@functools.lru_cache(maxsize=1)
def conf_methods() -> tuple[str, ...]:
    """The options of conf/method (the folder is the registry, as Hydra lists the group)."""
    return tuple(sorted(p.stem for p in (paths.conf_dir() / "method").glob("*.yaml")))


def method_order(present: Iterable[str] = ()) -> list[str]:
    """Every method of conf/method and of `present`, in display order: `none` first, then those
    listed in conf/report/methods.yaml in its order, then the others by name, a stack (`a+b`)
    right after the last of its members (at the end when one is unknown). Deterministic, so a
    new method has its place without a line of code."""
    listed = [m for m in METHODS if m != BASELINE_METHOD]
    others = sorted({*conf_methods(), *map(str, present)} - set(METHODS) - {BASELINE_METHOD})
    base = [BASELINE_METHOD, *listed, *(m for m in others if "+" not in m)]
    pos = {m: i for i, m in enumerate(base)}
    end = len(base)

    def key(m: str) -> tuple:
        if m in pos:
            return pos[m], 0, m
        members = m.split("+")
        return (max(pos[x] for x in members) if all(x in pos for x in members) else end), 1, m

    return sorted([*base, *(m for m in others if "+" in m)], key=key)


def _column(key: str) -> str:
    """A rule's key as a column: 'kernel_size' -> 'method.kernel_size'; 'method' stays."""
    return key if key == "method" or key.startswith("method.") else f"method.{key}"


def _is_bool(v: Any) -> bool:
    return isinstance(v, (bool, np.bool_))


def _fill(template: str, row: Mapping[str, Any]) -> tuple[str, set[str]]:
    """A setting's name with its `{parameter}`s replaced by the row's values, and their columns."""
    used: set[str] = set()

    def value(m: re.Match) -> str:
        used.add(col := _column(m.group(1)))
        return "" if isna(v := row.get(col)) else fmt_value(v)

    text = re.sub(r"\{(\w+)\}", value, template)
    return (" ".join(text.split()) if used else text), used


def fmt_value(v: Any) -> str:
    """0.5 -> '0.5', 2.0 -> '2', True -> 'true', 'max' -> 'max': compact values for labels."""
    if _is_bool(v):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def isna(v: Any) -> bool:
    """None or NaN: a missing value of a summary column."""
    return v is None or (isinstance(v, float) and math.isnan(v))


@dataclass
class Names:
    """How settings and panels are named. See the module docstring for the mapping's keys."""

    params: dict[str, str] = field(default_factory=lambda: dict(PARAMS))
    settings: list[dict[str, Any]] = field(default_factory=lambda: [dict(s) for s in SETTINGS])
    labels: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=lambda: dict(MODELS))
    datasets: dict[str, str] = field(default_factory=lambda: dict(DATASETS))

    def param(self, key: str, value: Any) -> str:
        """'k=2', 'conv+bn' (value alone), 'prune_head=true' (booleans keep their name)."""
        name = self.params.get(key, key)
        v = fmt_value(value)
        return v if name == "" and not _is_bool(value) else f"{name or key}={v}"

    def named(self, row: Mapping[str, Any]) -> tuple[str, set[str]] | None:
        """(name, the columns it stands for) of the first rule in `settings` that `row` matches.
        A name may hold parameters, `{kernel_size}`: the row's value (a missing one is left out,
        with its space), a column the name then stands for too."""
        for rule in self.settings:
            cond = {_column(k): v for k, v in rule.items() if k != "name"}
            if all(fmt_value(row.get(c)) == fmt_value(v) for c, v in cond.items()):
                name, used = _fill(str(rule["name"]), row)
                return name or str(row.get("method", "")), set(cond) | used
        return None

    def setting(self, row: Mapping[str, Any], skip: Iterable[str] = ()) -> str:
        """The method and its parameters but `skip` (or the setting's own name, then the
        parameters the name does not cover), e.g. 'checkpoint b=0.65'."""
        named = self.named(row)
        parts = [named[0] if named else str(row.get("method", ""))]
        covered = named[1] if named else set()
        skip = set(skip) | covered
        context = {key: name for (col, value, key), name in CONTEXT_PARAMS.items()
                   if fmt_value(row.get(f"method.{col}")) == value}
        unused = {f"method.{k}" for (col, value), keys in UNUSED_PARAMS.items()
                  if fmt_value(row.get(f"method.{col}")) == value for k in keys}
        shown = [(k.removeprefix("method."), v) for k, v in row.items() if isinstance(k, str)
                 and k.startswith("method.") and k not in skip | unused and not isna(v)]
        # a stack's member options (method.quantize.bits) by their own short names; prefixed
        # with the member only where two members vary an option of the same name
        leaf = [key.rpartition(".")[2] for key, _ in shown]
        for (key, v), name in zip(shown, leaf):
            if key in context:
                parts.append(f"{context[key]}={fmt_value(v)}")
            elif "." in key and leaf.count(name) > 1:
                parts.append(f"{key.rpartition('.')[0]}.{self.param(name, v)}")
            else:
                parts.append(self.param(name, v))
        return " ".join(parts)

    def relabel(self, label: str) -> str:
        return self.labels.get(label, label)

    def model(self, model: Any) -> str:
        return self.models.get(str(model), str(model))

    def dataset(self, dataset: Any) -> str:
        return self.datasets.get(str(dataset), str(dataset))

    def panel(self, model: Any, dataset: Any) -> str:
        """'MLP-6 / Fashion-MNIST': a panel title names model and dataset."""
        return f"{self.model(model)} / {self.dataset(dataset)}"


DEFAULT = Names()


def load(spec: Names | Mapping[str, Any] | str | os.PathLike | None = None,
         labels: Mapping[str, str] | None = None) -> Names:
    """Names from the defaults, overridden by `spec` (a mapping or a YAML file of one, see the
    module docstring) and by `labels` (label as drawn -> another).

    Raises:
        ValueError: the file cannot be read or parsed, or a key or value has the wrong shape.
    """
    if isinstance(spec, Names):
        user: Mapping[str, Any] = {}
        base = spec
    else:
        base = Names()
        user = _read(spec) if isinstance(spec, (str, os.PathLike)) else dict(spec or {})
    bad = sorted(set(user) - set(KEYS))
    if bad:
        raise ValueError(f"names: unknown key {bad[0]!r}; valid keys: {', '.join(KEYS)}")
    out = Names(dict(base.params), [dict(s) for s in base.settings], dict(base.labels),
                dict(base.models), dict(base.datasets))
    for key in ("params", "labels", "models", "datasets"):
        value = user.get(key) or {}
        if not isinstance(value, Mapping):
            raise ValueError(f"names: {key} must be a mapping (name: short name), got {value!r}")
        getattr(out, key).update({str(k): "" if v is None else str(v) for k, v in value.items()})
    rules = user.get("settings") or []
    if not isinstance(rules, list) or not all(isinstance(r, Mapping) and "name" in r
                                              for r in rules):
        raise ValueError("names: settings must be a list of mappings with a name, e.g. "
                         "[{method: pool, kernel_size: 1, name: pool compaction only}]")
    out.settings = [dict(r) for r in rules] + out.settings  # the user's rules first
    out.labels.update(labels or {})
    return out


def parse_label(spec: str) -> tuple[str, str]:
    """'pool k=2:Pool (k=2)' -> ('pool k=2', 'Pool (k=2)'): split at the first ':' (labels as
    drawn never hold one; the new name may)."""
    old, sep, new = spec.partition(":")
    if not sep or not old.strip() or not new.strip():
        raise ValueError(f"--label must look like 'LABEL:NEW NAME', got {spec!r}")
    return old.strip(), new.strip()
