"""What a config may build: memtrain's own classes and functions, and those of packages a user
has installed and registered, nothing else.

A config names what it builds by a dotted path (`_target_`; in Hydra's logging configs, the
`class` and `()` keys of logging.config.dictConfig). Without a rule, `method._target_=os.system`
runs a shell command. The rule, by the slot the path fills:

    method.*          memtrain.methods          model     memtrain.models
    dataset           memtrain.data, memtrain.imagefolder
    hydra.callbacks   memtrain.hydra_callbacks, memtrain.report.callback
    hydra.launcher    hydra_plugins.memtrain_launcher, Hydra's core, joblib and submitit plugins
    hydra.sweeper     hydra_plugins.memtrain_sweeper, Hydra's own core plugins
    hydra logging     logging (handlers, formatters, filters)     anywhere else: memtrain

and, in every slot, a prefix an installed package registers under the `memtrain.trusted` entry
point group, e.g. in its pyproject.toml: `[project.entry-points."memtrain.trusted"] mine =
"my_methods"`. What a path resolves to must be *defined* under an allowed prefix (its
`__module__`), so a trusted module's imports are no way around it (`memtrain.methods.none.nn`
is torch's, `memtrain.data.os.system` is os.system: refused), and a slot's own prefix keeps a
config from calling one of memtrain's helpers that writes files (`memtrain.record.*`).

Checked as strings before anything is imported and then resolved (`check_config`, from the
CLI's and the API's checks), and again where the runner builds (`locate`), so launchers' jobs
are held to it too. docs/SECURITY.md says what a config and a preset may do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from typing import Any

from memtrain.errors import ConfigError

HYDRA_CORE = "hydra._internal.core_plugins"
SLOTS = {  # key prefix -> where what fills it may be defined
    "method": ("memtrain.methods",),
    "model": ("memtrain.models",),
    "dataset": ("memtrain.data", "memtrain.imagefolder", "memtrain.tokens"),
    "hydra.callbacks": ("memtrain.hydra_callbacks", "memtrain.report.callback"),
    # memtrain's launchers, and Hydra's own plugins its presets use (hydra/launcher=parallel)
    "hydra.launcher": ("hydra_plugins.memtrain_launcher", HYDRA_CORE,
                       "hydra_plugins.hydra_joblib_launcher",
                       "hydra_plugins.hydra_submitit_launcher"),
    "hydra.sweeper": ("hydra_plugins.memtrain_sweeper", HYDRA_CORE),
    "hydra.job_logging": ("logging",),
    "hydra.hydra_logging": ("logging",),
}
OTHER = ("memtrain",)
ENTRY_POINTS = "memtrain.trusted"


def registered() -> tuple[str, ...]:
    """The prefixes installed packages register under the `memtrain.trusted` entry point."""
    return _registered(tuple(sys.path))


@functools.cache
def _registered(path: tuple[str, ...]) -> tuple[str, ...]:
    """Read once per import path (scanning every installed package's metadata takes ~5 ms)."""
    return tuple(ep.value.strip() for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)
                 if ep.value.strip())


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def allowed(where: str) -> tuple[str, ...]:
    """The prefixes a build key at `where` (a dotted key path) may name."""
    slot = next((s for s in SLOTS if where == s or where.startswith(s + ".")), None)
    return (SLOTS[slot] if slot else OTHER) + registered()


def _refusal(where: str, path: Any, reason: str = "") -> ConfigError:
    listed = ", ".join(f"{p}.*" for p in allowed(where))
    return ConfigError(f"{where}={path}: {reason}may name only {listed} (memtrain builds only its "
                       f"own classes; register a package of yours under the '{ENTRY_POINTS}' "
                       "entry point: docs/SECURITY.md)")


def check_path(where: str, path: Any) -> None:
    """A dotted path a config names at key `where`, checked as a string (nothing imported)."""
    if not isinstance(path, str) or not _under(path.strip(), allowed(where)):
        raise _refusal(where, path)


def resolve(path: str, where: str) -> Any:
    """Import the longest module prefix of a dotted path, then its attributes (Hydra's rule)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name != e.name and not name.startswith(e.name + "."):
                raise ConfigError(f"{where}={path}: importing {name} fails: {e}") from None
            continue
        for a in parts[i:]:
            if not hasattr(obj, a):
                raise ConfigError(f"{where}={path}: {name} has no {a!r}") from None
            obj = getattr(obj, a)
        return obj
    raise ConfigError(f"{where}={path}: no such module") from None


def locate(path: str, where: str) -> Any:
    """The object a `_target_` (or logging factory) at key `where` names, imported; refused
    (ConfigError) when the path is not allowed there or resolves to something defined elsewhere."""
    check_path(where, path)
    obj = resolve(path.strip(), where)
    module = getattr(obj, "__module__", None) or ""
    if not _under(module, allowed(where)):
        name = f"{module}.{getattr(obj, '__qualname__', '')}".strip(".")
        raise _refusal(where, path, f"is {name or 'an object'}, defined outside memtrain; it ")
    return obj


def targets(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(key, value) of every build key in a plain (container) config: `_target_` anywhere;
    `class` and `()` inside Hydra's logging configs."""
    if isinstance(node, dict):
        in_logging = where.startswith(("hydra.job_logging", "hydra.hydra_logging"))
        for k, v in node.items():
            key = f"{where}.{k}" if where else str(k)
            if k == "_target_" or (in_logging and k in ("class", "()")):
                yield key, v
            else:
                yield from targets(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from targets(v, f"{where}[{i}]")


def check_config(container: dict) -> None:
    """Every build key of a composed config (hydra node included): first all as strings, then
    each resolved, so that what it is defined by is checked too."""
    found = list(targets(container))
    for key, value in found:
        check_path(key, value)
    for key, value in found:
        locate(value, key)
