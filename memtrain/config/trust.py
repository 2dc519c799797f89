"""What a config may build: memtrain's own classes and functions, and those of packages a user
has installed and registered, nothing else.

A config names what it builds by a dotted path (`_target_`). Without a rule,
`method._target_=os.system` runs a shell command. The rule, by the slot the path fills:

    method.*          memtrain.methods          model     memtrain.models
    dataset           memtrain.data
    hydra.callbacks   memtrain.hydra_callbacks, memtrain.report.callback
    hydra.launcher    hydra_plugins.memtrain_launcher, Hydra's core, joblib and submitit plugins
    hydra.sweeper     hydra_plugins.memtrain_sweeper, Hydra's own core plugins
    anywhere else     memtrain

and, in every slot, a prefix an installed package registers under the `memtrain.trusted` entry
point group, e.g. in its pyproject.toml: `[project.entry-points."memtrain.trusted"] mine =
"my_methods"`. What a path resolves to must be *defined* under an allowed prefix (its
`__module__`), so a trusted module's imports are no way around it (`memtrain.methods.none.nn`
is torch's, `memtrain.data.os.system` is os.system: refused), and a slot's own prefix keeps a
config from calling one of memtrain's helpers that writes files (`memtrain.record.*`).

Checked as strings before anything is imported and then resolved (`check_config`, from the
CLI's and the API's checks), and again where the runner builds (`locate`), so launchers' jobs
are held to it too.

Hydra's logging configs (`hydra.job_logging`, `hydra.hydra_logging`: logging.config.dictConfig's
schema, whose `class`, `()` and `ext://` values import and call anything, and whose file handlers
write anywhere) are held to a narrower rule, `check_logging`: the handlers memtrain uses (a
console stream, the run folder's log file), plain formatters and filters, plain values.
docs/SECURITY.md says what a config and a preset may do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from typing import Any

from memtrain.errors import ConfigError

HYDRA_CORE = "hydra._internal.core_plugins"
SLOTS = {  # key prefix -> where what fills it may be defined
    "method": ("memtrain.methods",),
    "model": ("memtrain.models",),
    "dataset": ("memtrain.data",),
    "hydra.callbacks": ("memtrain.hydra_callbacks", "memtrain.report.callback"),
    # memtrain's launchers, and Hydra's own plugins its presets use (hydra/launcher=parallel)
    "hydra.launcher": ("hydra_plugins.memtrain_launcher", HYDRA_CORE,
                       "hydra_plugins.hydra_joblib_launcher",
                       "hydra_plugins.hydra_submitit_launcher"),
    "hydra.sweeper": ("hydra_plugins.memtrain_sweeper", HYDRA_CORE),
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
    """(key, value) of every `_target_` in a plain (container) config; Hydra's logging configs
    are left to `check_logging`."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{where}.{k}" if where else str(k)
            if k == "_target_":
                yield key, v
            elif key not in LOGGING:
                yield from targets(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from targets(v, f"{where}[{i}]")


def check_config(container: dict) -> None:
    """Every build key of a composed config (hydra node included): first all as strings, then
    each resolved, so that what it is defined by is checked too; Hydra's logging configs by
    `check_logging`."""
    hydra = container.get("hydra")
    if isinstance(hydra, dict):
        check_logging(hydra)
    found = list(targets(container))
    for key, value in found:
        check_path(key, value)
    for key, value in found:
        locate(value, key)


# ---------------------------------------------------------------- Hydra's logging configs

LOGGING = ("hydra.job_logging", "hydra.hydra_logging")
RUN_FOLDER = "${hydra.runtime.output_dir}/"  # what a log file's name starts with
JOB_NAME = "${hydra.job.name}"  # the one interpolation a log file's name may hold besides
STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
# logging.config.dictConfig's sections, and the keys an entry of each may set (a handler's: by
# its class). No `()` factory but the two plain classes, no `.` (attributes set after building)
TOP_KEYS = {"version", "formatters", "filters", "handlers", "loggers", "root", "incremental",
            "disable_existing_loggers"}
HANDLER_KEYS = {"class", "level", "formatter", "filters"}
HANDLERS = {"logging.StreamHandler": {"stream"},
            "logging.FileHandler": {"filename", "mode", "encoding", "delay", "errors"}}
FORMATTER_KEYS = {"class", "()", "format", "datefmt", "style", "validate"}
FILTER_KEYS = {"()", "name"}
LOGGER_KEYS = {"level", "handlers", "filters", "propagate"}
HANDLER_RULE = ("a log handler may be logging.StreamHandler (the console) or "
                "logging.FileHandler (a NAME.log in the run folder)")


def _log_refusal(key: str, value: Any, reason: str) -> ConfigError:
    shown = value if isinstance(value, (str, int, float, bool)) or value is None else \
        type(value).__name__
    return ConfigError(f"{key}={shown}: {reason} (what a logging config may hold: "
                       "docs/SECURITY.md)")


def check_logging(hydra: dict) -> None:
    """Hydra's logging configs (`hydra` is the composed config's hydra node, unresolved) hold
    only what memtrain's own logging uses: handlers that write to the console or to a `.log`
    file directly in the run folder (the job's config only: Hydra configures its own logging
    before the run folder exists), `logging.Formatter` with a '%' or '$' format (Hydra refuses
    '{', whose fields reach into objects), `logging.Filter` by logger name, and plain values
    (no `ext://` but the console's streams, no `cfg://`, no interpolation but the log file's
    folder and the job's name). Anything else, a `logging.config.fileConfig` or a file handler
    of a chosen path, is a one-line ConfigError naming its key."""
    name = hydra.get("job", {}).get("name") if isinstance(hydra.get("job"), dict) else None
    if name is not None and not (isinstance(name, str) and PLAIN_NAME.fullmatch(name)):
        raise ConfigError(f"hydra.job.name={name}: it names the run's log file "
                          f"({JOB_NAME}.log in the run folder), so it must be a plain name "
                          "(letters, digits and _ . + -, no folder, no interpolation)")
    for section in ("job_logging", "hydra_logging"):
        node = hydra.get(section)
        if node is not None:
            _check_logging_node(f"hydra.{section}", node, files=section == "job_logging")


def _entries(where: str, node: dict, section: str) -> dict:
    entries = node.get(section)
    if entries is None:
        return {}
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise _log_refusal(f"{where}.{section}", entries, "must be a mapping of named entries")
    return entries


def _check_logging_node(where: str, node: Any, files: bool) -> None:
    if not isinstance(node, dict):
        raise _log_refusal(where, node, "must be a mapping (logging.config.dictConfig's)")
    for key in node:
        if key not in TOP_KEYS:
            raise _log_refusal(f"{where}.{key}", node[key], "is no section of a logging config "
                                                            f"({', '.join(sorted(TOP_KEYS))})")
    _plain_values(where, node)
    formatters = _entries(where, node, "formatters")
    filters = _entries(where, node, "filters")
    handlers = _entries(where, node, "handlers")
    for fid, f in formatters.items():  # what it builds first, then its keys
        for key in ("class", "()"):
            if key in f and f[key] != "logging.Formatter":
                raise _log_refusal(f"{where}.formatters.{fid}.{key}", f[key],
                                   "a formatter may be logging.Formatter only")
        _check_keys(f"{where}.formatters.{fid}", f, FORMATTER_KEYS)
        if f.get("style", "%") not in ("%", "$"):
            raise _log_refusal(f"{where}.formatters.{fid}.style", f.get("style"),
                               "a format's style may be '%' or '$'")
    for fid, f in filters.items():
        if "()" in f and f["()"] != "logging.Filter":
            raise _log_refusal(f"{where}.filters.{fid}.()", f["()"],
                               "a filter may be logging.Filter only")
        _check_keys(f"{where}.filters.{fid}", f, FILTER_KEYS)
    for hid, h in handlers.items():
        _check_handler(f"{where}.handlers.{hid}", h, files, formatters, filters)
    named = [("root", node.get("root"))] + [(f"loggers.{k}", v) for k, v in
                                            _entries(where, node, "loggers").items()]
    for key, logger in named:
        if logger is None:
            continue
        if not isinstance(logger, dict):
            raise _log_refusal(f"{where}.{key}", logger, "must be a mapping")
        _check_keys(f"{where}.{key}", logger, LOGGER_KEYS)
        _check_names(f"{where}.{key}.handlers", logger.get("handlers"), handlers, "handler")
        _check_names(f"{where}.{key}.filters", logger.get("filters"), filters, "filter")


def _check_handler(where: str, h: dict, files: bool, formatters: dict, filters: dict) -> None:
    cls = h.get("class")
    if cls not in HANDLERS or (cls == "logging.FileHandler" and not files):
        reason = ("Hydra's own logging is configured before the run folder exists: it may log "
                  "to the console only (logging.StreamHandler)" if cls == "logging.FileHandler"
                  else HANDLER_RULE)
        raise _log_refusal(f"{where}.class", cls, reason)
    _check_keys(where, h, HANDLER_KEYS | HANDLERS[cls])
    if cls == "logging.StreamHandler" and h.get("stream", STREAMS[1]) not in STREAMS:
        raise _log_refusal(f"{where}.stream", h.get("stream"),
                           "a console handler writes to ext://sys.stdout or ext://sys.stderr")
    if cls == "logging.FileHandler":
        filename = h.get("filename")
        leaf = filename.removeprefix(RUN_FOLDER) if isinstance(filename, str) else ""
        plain = leaf.replace(JOB_NAME, "memtrain")
        if not (isinstance(filename, str) and filename.startswith(RUN_FOLDER)
                and leaf.endswith(".log") and PLAIN_NAME.fullmatch(plain)):
            raise _log_refusal(f"{where}.filename", filename,
                               f"a log file must be {RUN_FOLDER}NAME.log, directly in the "
                               "run folder")
        if h.get("mode", "a") not in ("a", "w"):
            raise _log_refusal(f"{where}.mode", h.get("mode"), "a log file's mode is 'a' or 'w'")
    if h.get("formatter") is not None:
        _check_names(f"{where}.formatter", [h["formatter"]], formatters, "formatter")
    _check_names(f"{where}.filters", h.get("filters"), filters, "filter")


def _check_keys(where: str, entry: dict, allowed: set[str]) -> None:
    for key in entry:
        if key not in allowed:
            raise _log_refusal(f"{where}.{key}", entry[key],
                               f"is not a key memtrain's logging allows here; it may "
                                   f"set {', '.join(sorted(allowed))}")


def _check_names(where: str, names: Any, defined: dict, what: str) -> None:
    """A list of entries by name: each defined in the same config (dictConfig's own error for
    a missing one is a traceback)."""
    if names is None:
        return
    if not isinstance(names, list):
        raise _log_refusal(where, names, f"must be a list of {what} names")
    for n in names:
        if n not in defined:
            raise _log_refusal(where, n, f"no {what} of that name is defined "
                                         f"({', '.join(map(str, defined)) or 'none'})")


def _plain_values(where: str, node: Any) -> None:
    """No value resolves to something at run time: no `ext://` (dictConfig imports the module
    it names) but a console stream, no `cfg://`, no interpolation but a log file's name's."""
    if isinstance(node, dict):
        for k, v in node.items():
            _plain_values(f"{where}.{k}", v)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _plain_values(f"{where}[{i}]", v)
    elif isinstance(node, str):
        interpolated = "${" in node.replace(RUN_FOLDER, "", 1).replace(JOB_NAME, "") \
            if where.endswith(".filename") else "${" in node
        if interpolated:
            raise _log_refusal(where, node, "a logging config holds plain values (no "
                                            "interpolation but a log file's "
                                            f"{RUN_FOLDER}{JOB_NAME})")
        if node.startswith(("ext://", "cfg://")) and not (where.endswith(".stream")
                                                          and node in STREAMS):
            raise _log_refusal(where, node, "dictConfig would import or look up what it "
                                            "names; a console handler's stream may be "
                                            f"{' or '.join(STREAMS)}")
