"""Command-line overrides checked before Hydra composes or anything trains: unknown groups,
options and keys (with a did-you-mean), values of the wrong type, override syntax. Each problem
is one ConfigError line.

Types come from the defaults in conf/: an option whose default is an integer takes integers, a
boolean takes true/false, a list takes a list; a default of null takes anything (the builders
check those). Ranges, choices and the data's memory are each job's own checks
(`runner.check`), which loader.check_overrides runs on the jobs before anything is written: a
single run's bad value is one line and no folder; in a multirun a value bad for every job stops
the sweep at once, one bad for some jobs only is their `status=error` rows. A wrong key or type
stops the whole sweep at once (every job would fail).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from memtrain.config import schema
from memtrain.errors import ConfigError
from memtrain.record import GROUPS


def parse(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out = []
    for line in overrides:  # one at a time, so the message names the one that fails
        try:
            out += parser.parse_overrides([line])
        except OverrideParseException as e:
            hint = ""
            if line.startswith("hydra.sweeper.variants="):  # a variant holds '=' and spaces
                hint = ('; quote each variant: \'hydra.sweeper.variants=["method=none",'
                        '"method=prune method.sparsity=0.5,0.9"]\'')
            raise ConfigError(f"cannot parse the override {line!r}: "
                              f"{str(e).splitlines()[0]}{hint}") from None
    return out


def _choices(o) -> list[str]:
    """The option names a group override selects ([] for sweeps we do not expand)."""
    if not o.is_sweep_override():
        v = o.value()
        return [] if v is None else [str(v)]
    return list(o.sweep_string_iterator()) if hasattr(o.value(), "list") else []


def check_groups(parsed: list, options: Callable[[str], list[str]]) -> None:
    """Every group option named must exist: `model=resnet99` lists the real ones."""
    for o in parsed:
        if o.key_or_group not in GROUPS or o.is_delete():
            continue
        valid = options(o.key_or_group)
        for choice in _choices(o):
            if choice not in valid:
                hint = difflib.get_close_matches(choice, valid, n=1)
                by_name = f"; or a library's model by name: model=timm|torchvision|hf " \
                    f"model.name={choice} (docs/extending.md)" if o.key_or_group == "model" else ""
                raise ConfigError(f"unknown {o.key_or_group} {choice!r}; choose one of: "
                                  f"{', '.join(valid)}"
                                  + (f"; did you mean {hint[0]!r}?" if hint else "") + by_name)


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, DictConfig):
        out = []
        for k in node:
            out += _leaf_paths(node._get_node(k), f"{prefix}{k}.") or [f"{prefix}{k}"]
        return out
    return []


def _suggest(cfg: DictConfig, key: str, siblings: list[str]) -> str | None:
    """The option meant: the same name in another group (trainer.lr -> optim.lr), else a close
    name beside it (trainer.batchsize -> trainer.batch_size)."""
    leaves = [p for p in _leaf_paths(cfg) if not p.endswith("_target_")]
    name = key.rsplit(".", 1)[-1]
    same = [p for p in leaves if p.rsplit(".", 1)[-1] == name]
    if same:
        return same[0]
    by_name = {s.rsplit(".", 1)[-1]: s for s in siblings}
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.6)
    return by_name[close[0]] if close else None


def _missing(cfg: DictConfig, key: str) -> str | None:
    """None when `key` exists in cfg, else the message for it."""
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node.keys():  # noqa: SIM118 (`in node` is False for ??? values)
            node = node._get_node(part)
            continue
        if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
            continue
        here = ".".join(parts[:i])
        if not isinstance(node, DictConfig):
            return f"unknown option {key}: {here} is a value, not a group of options"
        siblings = [f"{here}.{k}" if here else str(k) for k in node if k != "_target_"]
        hint = _suggest(cfg, key, siblings)
        if hint:
            return f"unknown option {key}; did you mean {hint}?"
        return f"unknown option {key}; {here or 'the config'} has: {', '.join(siblings)}"
    return None


def _type_error(cfg: DictConfig, key: str, default: Any, value: Any) -> str | None:
    """The message when `value` cannot stand for option `key` (schema.problem), else None."""
    group, _, name = key.partition(".")
    node = cfg.get(group) if "." not in name else None
    ann = (schema.expected_type(group, name, node, default) if isinstance(node, DictConfig)
           else schema.type_of_default(default))
    return schema.problem(key, ann, value)


def _values(o) -> list[Any]:
    """The values an override sets: one, a choice sweep's list or a range's members."""
    if not o.is_sweep_override():
        return [o.value()]
    v = o.value()
    if hasattr(v, "list"):
        return [getattr(e, "text", e) for e in v.list]
    return list(o.sweep_iterator()) if hasattr(v, "step") else []


def check_values(parsed: list, compose: Callable[[list[str]], DictConfig]) -> None:
    """Every `key=value` override names an existing option and has its default's type.

    The config is composed once per option of the key's group that the command selects (a
    method sweep checks `method.kernel_size` against each method), with no value overrides.
    """
    groups = {o.key_or_group: _choices(o) for o in parsed
              if o.key_or_group in GROUPS and not o.is_delete()}
    cache: dict[tuple[str, ...], DictConfig] = {}

    def config_for(group: str, choice: str | None) -> DictConfig:
        sel = {g: c[0] for g, c in groups.items() if c}
        if choice is not None:
            sel[group] = choice
        # in the command's order, as `selection` gives it (one compose for both checks)
        key = tuple(f"{g}={c}" for g, c in sel.items())
        if key not in cache:
            cache[key] = compose(list(key))
        return cache[key]

    for o in parsed:
        key = o.key_or_group
        if (key in GROUPS or "/" in key or key.startswith("hydra") or o.is_add()
                or o.is_force_add()):
            continue
        top = key.split(".")[0]
        for choice in groups.get(top) or [None]:
            cfg = config_for(top, choice)
            where = f" (with {top}={choice})" if choice and len(groups.get(top, [])) > 1 else ""
            msg = _missing(cfg, key)
            if msg:
                raise ConfigError(msg + where)
            if o.is_delete():
                continue
            default = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
            if isinstance(default, (DictConfig, ListConfig)):
                default = OmegaConf.to_container(default, resolve=False)
            for value in _values(o):
                msg = _type_error(cfg, key, default, value)
                if msg:
                    raise ConfigError(msg + where)


def check_output_dirs(parsed: list) -> None:
    """`hydra.run.dir` / `hydra.sweep.dir` must be a folder we can make (not a file, nor under
    one, nor on a read-only disk): made here, so the failure is one line, not Hydra's traceback."""
    for o in parsed:
        if o.key_or_group not in ("hydra.run.dir", "hydra.sweep.dir") or o.is_sweep_override():
            continue
        value = str(o.value())
        if "${" in value:  # resolved by Hydra (e.g. ${now:...}); checked when it makes it
            continue
        try:
            Path(value).expanduser().mkdir(parents=True, exist_ok=True)
            probe = Path(value).expanduser() / f".memtrain-write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            reason = e.strerror or type(e).__name__
            if isinstance(e, FileExistsError) or Path(value).expanduser().is_file():
                reason = "a file of that name exists"
            raise ConfigError(f"{o.key_or_group}={value} cannot be used as the output folder: "
                              f"{reason}") from None


def selection(parsed: list) -> list[str]:
    """The group options the overrides select (the first of a sweep's)."""
    return [f"{o.key_or_group}={c[0]}" for o in parsed
            if o.key_or_group in GROUPS and not o.is_delete() and (c := _choices(o))]


def check_selection(parsed: list, compose: Callable[[list[str]], DictConfig]) -> None:
    """The options the command selects (built-in or the user's presets) compose, and every key
    they set is an option of its type (`schema.check_config`, interpolations left for the job)."""
    schema.check_config(compose(selection(parsed)), GROUPS, resolve=False)


BUILT = ("method", "model", "dataset")  # the groups the runner builds from their `_target_`


def check_targets(parsed: list, compose: Callable[..., DictConfig]) -> None:
    """What the command would build (memtrain/config/trust.py): every `_target_` of the composed
    config, Hydra's callbacks, launcher, sweeper and logging included, lies where memtrain builds
    from, checked before the job imports it; each option of a group sweep composed in turn.

    And a row names what ran: the `_target_`s under `method`, `model` and `dataset` are those of
    the option chosen (an override or a preset that swaps one for another class would record
    `method=none` for a run of quantize)."""
    from memtrain.config import offline, trust

    # (a sweep's params and variants are checked as overrides of their own: config._check_sweep)
    plain = [o.input_line for o in parsed if not o.is_sweep_override()
             and o.key_or_group not in GROUPS
             and not o.key_or_group.startswith(("hydra.sweeper.params", "hydra.sweeper.variants"))]
    for o in parsed:  # a sweep over a build key: each of its values
        if o.is_sweep_override() and o.key_or_group.split(".")[-1] == "_target_":
            for v in _values(o):
                trust.locate(str(v), o.key_or_group)
    # a sweep over a logging setting (or the job's name, which names the log file): each value
    logs = [o for o in parsed if o.is_sweep_override() and not o.is_delete()
            and o.key_or_group.startswith((*trust.LOGGING, "hydra.job.name"))]
    # a model sweep's values: each held to the offline rule (memtrain/config/offline.py)
    swept = [(o.key_or_group, _values(o)) for o in parsed
             if o.is_sweep_override() and o.key_or_group.startswith("model.")]
    chosen = selection(parsed)
    selections = [chosen]
    for o in parsed:
        if o.key_or_group in GROUPS and not o.is_delete():
            for c in _choices(o)[1:]:
                selections.append([s for s in chosen if not s.startswith(f"{o.key_or_group}=")]
                                  + [f"{o.key_or_group}={c}"])
    named_by: dict[str, dict] = {}  # "group=choice" -> that option's build keys
    lines = [o.input_line for o in parsed]
    defaults: list[DictConfig | None] = []  # the config of no overrides, where it composes

    def alone(group: str, choice: str) -> DictConfig:
        """The config of `group=choice` alone: of a group's default option, the config of no
        overrides (the same defaults list), composed once for every group that chose it."""
        if not defaults:
            try:
                defaults.append(compose([], hydra=True))
            except ConfigError:  # a default left for the command to choose (`???`)
                defaults.append(None)
        if defaults[0] is not None and defaults[0].hydra.runtime.choices.get(group) == choice:
            return defaults[0]
        return compose([f"{group}={choice}"])
    for sel in selections:
        # the command's own order where these are its overrides: the job composes that order,
        # and the compose is then made once (loader.hydra_compose's cache)
        ov = lines if sel is chosen and sorted(sel + plain) == sorted(lines) else sel + plain
        cfg = compose(ov, hydra=True)
        container = OmegaConf.to_container(cfg, resolve=False)
        trust.check_config(container)
        for o in logs:
            for v in _values(o):
                trust.check_logging(_with(container["hydra"], o.key_or_group, v))
        offline.check_command(container, swept)
        choices = container["hydra"]["runtime"]["choices"]
        for group in BUILT:
            if not choices.get(group) or group not in container:
                continue
            option = f"{group}={choices[group]}"
            if option not in named_by:
                own = OmegaConf.to_container(alone(group, choices[group]), resolve=False)
                named_by[option] = dict(trust.targets(own.get(group, {}), group))
            ran, named = dict(trust.targets(container[group], group)), named_by[option]
            for key in sorted(set(ran) | set(named)):
                if ran.get(key) != named.get(key):
                    raise ConfigError(
                        f"{key}={ran.get(key)}: {group}={choices[group]} builds "
                        f"{named.get(key)}; a row names the option chosen, so choose the option "
                        f"that builds what you want ({group}=<name>, or a preset of yours under "
                        "--config-dir) instead of changing its _target_")


def _with(hydra: dict, key: str, value: Any) -> dict:
    """A copy of a (container) hydra node with `key` (hydra.a.b) set to `value`."""
    import copy

    out = copy.deepcopy(hydra)
    *parents, last = key.split(".")[1:]
    node = out
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value
    return out


def check(parsed: list, options: Callable[[str], list[str]],
          compose: Callable[[list[str]], DictConfig]) -> None:
    """All of the above but the output folders over parsed command-line overrides; raises
    ConfigError with one line. The caller checks the folders last (`check_output_dirs` makes
    them, which a bad value must not leave).

    `options(group)` lists a group's options and `compose(overrides)` composes a config, both on
    the search path of the command (loader.check_overrides)."""
    check_groups(parsed, options)
    compose = one_line(compose)
    check_selection(parsed, compose)
    if any(o.key_or_group not in GROUPS and not o.key_or_group.startswith("hydra")
           for o in parsed):
        check_values(parsed, compose)
    check_targets(parsed, compose)  # last: the checks above name a mistyped key better


def one_line(compose: Callable[[list[str]], DictConfig]) -> Callable[[list[str]], DictConfig]:
    """compose, with Hydra's composition errors (a preset setting a key its schema lacks, a
    missing default) as one ConfigError line: the most specific line of Hydra's message."""

    def wrapped(overrides: list[str], **kwargs) -> DictConfig:
        import yaml
        from hydra.errors import HydraException
        from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

        try:
            return compose(overrides, **kwargs)
        except yaml.YAMLError as e:  # a preset that is no plain YAML (a !!python/... tag)
            mark = getattr(e, "problem_mark", None)
            where = f"{mark.name} line {mark.line + 1}: " if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}{problem} (a preset holds plain values: no YAML tags that "
                              "build objects)") from None
        except (HydraException, OmegaConfBaseException) as e:
            # Hydra re-raises OmegaConf's error (which names the key) as its context
            inner = e.__cause__ or e.__context__
            cause = inner if isinstance(inner, OmegaConfBaseException) else e
            key = getattr(cause, "full_key", None) or ""
            group, _, name = key.partition(".")
            accepted = schema.accepted_keys(group, None) if name else None
            if isinstance(cause, ConfigKeyError) and accepted is not None:  # a typed group
                raise ConfigError(schema.unknown_key(group, name, accepted)) from None
            where = re.match(r"In '([^']+)'", str(e))
            suffix = f" (in {where[1]})" if where and cause is not e else ""
            # a typed key given a wrong value in a file: memtrain's words, as on the command line
            if isinstance(cause, ValidationError) and group == "trainer" and name:
                msg = schema.problem(key, schema.hints("trainer", None).get(name),
                                     getattr(cause, "value", None))
                if msg:
                    raise ConfigError(msg + suffix) from None
            lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
            msg = lines[0] if lines else type(cause).__name__
            msg = f"{key}: {msg}" if key else msg
            raise ConfigError(msg + suffix) from None

    return wrapped
