"""Configs: composing conf/ as the CLI does, checking overrides before Hydra, and a run's identity.

    check_overrides (one-line errors) -> compose (Hydra's compose API) -> run_id / identity

The CLI (cli.py), the API (api.py), the launchers and the runner all compose and name runs
through this module, so a job's folder, its row's run_id and skip_done agree everywhere. It
registers the typed trainer schema when imported; memtrain's resolvers
(memtrain/config/resolvers.py) are registered by memtrain's Hydra plugins, which Hydra's plugin
scan imports in every session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memtrain import record
from memtrain.config import offline, schema
from memtrain.errors import ConfigError
from memtrain.paths import conf_dir, installed_conf_dir  # noqa: F401 (loader.conf_dir)

# ---------------------------------------------------------------- compose


@contextlib.contextmanager
def session(config_path: str | None = None, config_dir: str | None = None):
    """Hydra initialised as `memtrain [--config-path P] [--config-dir D]` initialises it: the same
    search path (conf/ or P, relative to this package as Hydra reads it; D before the structured
    configs), built by Hydra's own functions, so the checks see the user's presets too."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.version import setbase

    setbase("1.3")  # what cli.py's @hydra.main says, for callers that do not go through it
    search = create_automatic_config_search_path(__file__, None, config_path or str(conf_dir()))
    if config_dir is not None:
        extra = Path(config_dir).expanduser().resolve()
        if not extra.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: no such folder")
        search.prepend(provider="command-line", path=f"file://{extra}",
                       anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name="memtrain", config_search_path=search)
    _parse_once()  # after the plugin scan of the first session, which registers the sources
    global _search_path, _search_state
    outer = _search_path, _search_state
    _search_path, _search_state = tuple((e.provider, e.path) for e in search.get_path()), None
    try:
        yield
    finally:
        _search_path, _search_state = outer
        GlobalHydra.instance().clear()


# ---------------------------------------------------------------- the composed configs, cached

# One process composes the same configs many times (each api.run checks its overrides with ~6
# compositions, the test suite and a notebook run many): Hydra's compose reads and merges every
# file of the defaults list each time (~0.1-0.2 s). A composition is a function of the search
# path's files (their bytes), the structured configs in Hydra's ConfigStore, the overrides, the
# current folder (hydra.runtime.cwd), the job name, Hydra's version base and the environment
# variables hydra.job.env_copy names: the cache is keyed on all of them and hands out a copy.
_search_path: tuple | None = None  # the session's search path: (provider, path) pairs
_search_state: tuple | None = None  # its files and structured configs, read once per session
_composed: dict[tuple, tuple] = {}
_COMPOSED_MAX = 256
# the configs without their hydra node, which are the same in any folder (`hydra_compose`)
_anywhere: dict[tuple, tuple] = {}
_ANYWHERE_MAX = 128


def _source_files(path: str) -> tuple | None:
    """(relative path, bytes) of every file Hydra can read under a search-path entry, or None
    where the entry is not a folder this can read (the composition is then not cached)."""
    import importlib.util
    import os

    if path.startswith("file://") or "://" not in path:  # Hydra's default scheme: file
        roots = [path.removeprefix("file://")]
    elif path.startswith("pkg://"):
        try:
            spec = importlib.util.find_spec(path[len("pkg://"):].replace("/", "."))
        except (ImportError, ValueError):
            return None
        roots = list(spec.submodule_search_locations or []) if spec else []
        if not roots:
            return None
    else:
        return None
    files = []
    for root in roots:
        if not os.path.isdir(root):
            files.append((root, None))
            continue
        for folder, dirs, names in os.walk(root):
            dirs.sort()
            for name in sorted(names):
                full = os.path.join(folder, name)
                try:
                    with open(full, "rb") as f:
                        files.append((full, f.read()))
                except OSError:
                    return None
    return tuple(files)


def _sources_state(paths) -> tuple | None:
    state = []
    for provider, path in paths:
        if path.startswith("structured://"):
            from hydra.core.config_store import ConfigStore

            def walk(node, prefix=""):
                for k, v in sorted(node.items()):
                    if isinstance(v, dict):
                        yield from walk(v, f"{prefix}{k}/")
                    else:
                        yield f"{prefix}{k}", v
            # the stored nodes themselves: kept alive by the key, compared by identity
            state.append((path, tuple((k, _Same(v)) for k, v in walk(ConfigStore.instance().repo))))
            continue
        files = _source_files(path)
        if files is None:
            return None
        state.append((provider, path, files))
    return tuple(state)


class _Same:
    """An object compared by identity (a ConfigStore node: replacing it changes the key)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _session_state() -> tuple | None:
    """What the session's search path holds (None: not cacheable, or no session)."""
    global _search_state
    if _search_path is None:
        return None
    if _search_state is None:
        _search_state = _sources_state(_search_path) or ()
    return _search_state or None


def group_options(group: str, name: str, search: list[str]) -> list[str]:
    """The options of a config group Hydra finds in this session (`search`: the command's
    hydra.searchpath overrides), cached like `hydra_compose`."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    state = _session_state()
    key = ("options", group, name, state) if state is not None and not search else None
    if key is not None and key in _composed:
        return list(_composed[key])
    found = GlobalHydra.instance().config_loader().get_group_options(
        group, ObjectType.CONFIG, name, search)
    if key is not None:
        _composed[key] = tuple(found)
        _trim(_composed, _COMPOSED_MAX)
    return list(found)


def _trim(cache: dict, most: int) -> None:
    while len(cache) > most:
        cache.pop(next(iter(cache)))


def _kept(cache: dict, most: int, key: tuple, make: Callable[[], Any]) -> Any:
    """cache[key], made by `make()` where it is missing (nothing kept if it raises); the most
    recently used last, at most `most` kept."""
    kept = cache.pop(key, None)
    if kept is None:
        kept = make()
    cache[key] = kept
    _trim(cache, most)
    return kept


def _valid(cache: dict, key: tuple | None) -> tuple | None:
    """The cached composition under key, if what it was made of beyond the key (the files of a
    config's own hydra.searchpath, the variables of hydra.job.env_copy) is unchanged; made the
    most recently used."""
    import os

    entry = cache.get(key) if key is not None else None
    if entry is None:
        return None
    extra_paths, extra_state, env, _ = entry
    if (_sources_state(extra_paths) != extra_state
            or {k: os.environ.get(k) for k in env} != env):
        return None
    cache[key] = cache.pop(key)  # most recently used last
    return entry


# Hydra parses every file of the defaults list again for each composition (its own cache lives
# for one), and a command composes several (the checks, then the job; a sweep's checks one per
# variant): parsing YAML into OmegaConf is a large part of each. The parse of each file is kept,
# keyed by the file's real path and its bytes (read again each time: no edit goes unseen), and
# Hydra gets a copy of it (it edits what it loads: it takes the defaults list out).
_parsed: dict[tuple, Any] = {}
_PARSED_MAX = 1024
_merged: dict[tuple, Any] = {}  # defaults list and session state -> merged config
_defaults: dict[tuple, Any] = {}  # options chosen and session state -> defaults list
_MERGED_MAX = 128


def _parse_once() -> None:
    """Wrap the load_config of the file and package config sources Hydra uses (the classes
    its registry holds: its plugin scan imports their modules anew) in `_parsed`, once."""
    import copy
    import dataclasses
    import os

    from hydra._internal.sources_registry import SourcesRegistry

    def file_of(source, config_path: str) -> str | None:  # where the source would read it
        name = source._normalize_file_name(config_path)
        if source.scheme() == "file":
            return os.path.realpath(os.path.join(source.path, name))
        from importlib import resources

        try:
            found = resources.files(source.path).joinpath(name)
        except (ValueError, ModuleNotFoundError, TypeError):
            return None
        return str(found) if isinstance(found, Path) else None  # not from a zip

    def cached(load):
        if getattr(load, "_memtrain_parse_once", False):
            return load

        def load_config(self, config_path: str):
            where = file_of(self, config_path)
            try:
                with open(where, "rb") as f:
                    text = f.read()
            except (OSError, TypeError):  # not there: the source says so in its own words
                return load(self, config_path)
            key = (type(self).__name__, self.provider, self.path, config_path, where, text)
            kept = _parsed.get(key)
            if kept is None:
                got = load(self, config_path)
                with open(where, "rb") as f:  # kept only if the file did not change meanwhile
                    if f.read() != text:
                        return got
                _parsed[key] = dataclasses.replace(got, config=copy.deepcopy(got.config),
                                                   header=dict(got.header))
                while len(_parsed) > _PARSED_MAX:
                    _parsed.pop(next(iter(_parsed)))
                return got
            return dataclasses.replace(kept, config=copy.deepcopy(kept.config),
                                       header=dict(kept.header))

        load_config._memtrain_parse_once = True
        return load_config

    for scheme in ("file", "pkg"):
        source = SourcesRegistry.instance().resolve(scheme)
        source.load_config = cached(source.load_config)

    # Each composition deep-copies Hydra's config repository (so that setting up its search
    # path leaves the original alone), and with it the structured source's ConfigStore: every
    # stored config, each time. The store itself is never changed
    # there (the copy's sources are replaced, and a load hands out a copy of its node), so the
    # copy of the source shares it.
    structured = SourcesRegistry.instance().resolve("structured")
    if not getattr(structured, "_memtrain_shares_store", False):
        def share_store(self, memo):
            memo[id(self)] = out = copy.copy(self)
            return out

        structured.__deepcopy__ = share_store
        structured._memtrain_shares_store = True

    # Most compositions in a session differ in their values alone (trainer.seed=1, the checks'
    # config of the command and of its selection): their defaults lists are the same, and so
    # is the merge of the files they name, the larger part of a composition. That merge is kept
    # per defaults list and session state (the search path's files and stored configs, as
    # `hydra_compose` keys them) and Hydra gets a copy to apply the values to. A repository
    # with more than the session's search path (a config's own hydra.searchpath) is merged anew.
    from hydra._internal import config_loader_impl
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.defaults_list import DefaultsList

    def session_repo(repo) -> tuple | None:
        """The session's state and Hydra's version base (which decides where a defaults list
        without `_self_` puts it), if repo reads the session's search path alone."""
        from hydra.version import getbase

        state = _session_state()
        sources = tuple((s.provider, s.path) for s in repo.get_sources())
        if state is None or sources != tuple((provider, path.split("://", 1)[-1])
                                             for provider, path in _search_path):
            return None
        return str(getbase()), state

    # The defaults list (the tree of the configs a composition merges) depends on the
    # overrides that choose a group's option alone, not on the values: kept per choice of
    # options. Overrides are told apart as Hydra's own `Overrides` does (a sweep's are neither).
    create = config_loader_impl.create_defaults_list
    if not getattr(create, "_memtrain_once", False):
        def defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing):
            state = session_repo(repo)
            if state is None:
                return create(repo, config_name, overrides_list, prepend_hydra, skip_missing)
            groups, values = [], []
            for o in overrides_list:
                if o.is_sweep_override():
                    continue
                if isinstance(o.value(), dict) or not repo.group_exists(o.key_or_group):
                    values.append(o)
                else:
                    groups.append(o.input_line)
            key = (config_name, tuple(groups), prepend_hydra, skip_missing, state)
            kept = _kept(_defaults, _MERGED_MAX, key, lambda: create(
                repo, config_name, overrides_list, prepend_hydra, skip_missing))
            return DefaultsList(defaults=list(kept.defaults), defaults_tree=kept.defaults_tree,
                                config_overrides=values, overrides=kept.overrides)

        defaults_list._memtrain_once = True
        config_loader_impl.create_defaults_list = defaults_list

    merge = ConfigLoaderImpl._compose_config_from_defaults_list
    if not getattr(merge, "_memtrain_merge_once", False):
        def merged(self, defaults, repo):
            state = session_repo(repo)
            if state is None:
                return merge(self, defaults, repo)
            key = (tuple((d.config_path, d.parent, d.package, d.is_self, d.primary)
                         for d in defaults), state)
            return copy.deepcopy(_kept(_merged, _MERGED_MAX, key,
                                       lambda: merge(self, defaults, repo)))

        merged._memtrain_merge_once = True
        ConfigLoaderImpl._compose_config_from_defaults_list = merged


def hydra_compose(name: str, overrides: list[str], return_hydra_config: bool = False, *,
                  shared: bool = False) -> DictConfig:
    """`hydra.compose(name, overrides, return_hydra_config)` inside `session()`, the same config
    from a cache when nothing it is made of changed: a deep copy the caller may change, or with
    `shared` the cached object itself, for callers that only read it (the checks)."""
    import copy
    import os

    from hydra import compose as hcompose
    from hydra.core.utils import JobRuntime
    from hydra.version import getbase

    state = _session_state()
    here = anywhere = None
    if state is not None and not any(o.split("=")[0].lstrip("+~") == "hydra.searchpath"
                                     for o in overrides):
        anywhere = ("compose", name, tuple(overrides), str(getbase()),
                    JobRuntime().get("name"), state)
        here = (*anywhere, os.getcwd())
    # The current folder is in the hydra node alone (hydra.runtime.cwd; the search path is
    # absolute): a config without that node is the same in any folder, and is looked up so
    # first, in a cache of its own (the checks compose each selection and each chosen option
    # so, for every test, notebook cell or sweep job in a folder of its own; the whole
    # command's configs, one a run folder, would push them out of a shared one).
    entry = None
    lookups = [(_composed, here)] if return_hydra_config else \
        [(_anywhere, anywhere), (_composed, here)]
    for cache, key in lookups:
        entry = _valid(cache, key)
        if entry is not None:
            break
    if entry is None:
        cfg = hcompose(name, overrides=list(overrides), return_hydra_config=True)
        try:
            extra_paths = tuple(("hydra.searchpath", str(p))
                                for p in (cfg.hydra.get("searchpath") or []))
            extra_state = _sources_state(extra_paths)
        except Exception:  # an unresolvable search path: Hydra said what it could; no cache
            extra_state = None
        if here is None or extra_state is None:
            return cfg if return_hydra_config else _without_hydra(cfg)
        env = {k: os.environ.get(k) for k in cfg.hydra.job.get("env_copy") or []}
        entry = _composed[here] = (extra_paths, extra_state, env, {True: cfg})
        _trim(_composed, _COMPOSED_MAX)
    if not return_hydra_config and anywhere is not None and _anywhere.get(anywhere) is not entry:
        _anywhere[anywhere] = entry
        _trim(_anywhere, _ANYWHERE_MAX)
    variants = entry[3]
    if return_hydra_config not in variants:
        variants[return_hydra_config] = _without_hydra(copy.deepcopy(variants[True]))
    cfg = variants[return_hydra_config]
    if shared:
        return cfg
    cfg = copy.deepcopy(cfg)
    OmegaConf.clear_cache(cfg)  # as composed: no resolver's value (${now:}) kept from a reader
    return cfg


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The config without its hydra node, as hydra.compose(return_hydra_config=False) gives it."""
    from omegaconf import open_dict

    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def check_overrides(overrides: list[str], *, config_path: str | None = None,
                    config_dir: str | None = None, config_name: str | None = None,
                    multirun: bool | None = False, jobs: bool = True) -> None:
    """Reject bad overrides before Hydra does, with a one-line message: unknown groups, options
    and keys (did-you-mean), wrong types, bad syntax, presets that do not compose
    (memtrain/config/validate.py), then the values of the jobs to run (`_check_jobs`: ranges, the
    data's memory, options a method cannot honour), so that bad input leaves no folder. The
    groups' options are those Hydra finds on the search path (`--config-dir`,
    `hydra.searchpath` included). `multirun`: also check the sweep (its params and variants)
    the command configures; None: when its `hydra.mode` is MULTIRUN (the CLI without -m). A
    single job (the API) is checked as itself. `jobs=False`: the values are left unchecked (a
    command that only shows the config, `--cfg` or `--info`)."""
    from memtrain.config import validate

    parsed = validate.parse(overrides)
    name = config_name or "config"
    # the user's search path applies to every config the checks compose
    search = [o.input_line for o in parsed if o.key_or_group == "hydra.searchpath"]
    with session(config_path, config_dir):
        def options(group: str) -> list[str]:  # schemas (base_*) are extended, not chosen
            return [o for o in group_options(group, name, search) if not o.startswith("base_")]

        def compose(selection: list[str], hydra: bool = False) -> DictConfig:
            # read, never changed, by the checks: the cached object itself
            return hydra_compose(name, [*selection, *search], return_hydra_config=hydra,
                                 shared=True)

        validate.check(parsed, options, compose)
        sweep = _check_sweep(parsed, options, compose, multirun) if multirun is not False \
            else None
        if jobs:
            _check_jobs(parsed, name, sweep)
    validate.check_output_dirs(parsed)  # last: it makes the folders


def _check_sweep(parsed: list, options, compose, multirun: bool | None
                 ) -> tuple[DictConfig, list[str], list[str]] | None:
    """The sweep a command configures: `hydra.sweeper.params` with the command's overrides, and
    each of `hydra.sweeper.variants` (hydra/sweeper=variants) with them, checked as overrides.
    Returns (hydra node, the common overrides, the variants) of a multirun, else None."""
    from memtrain.config import validate
    from memtrain.config.sweeper import variant_overrides

    own = [o.input_line for o in parsed
           if o.key_or_group.startswith(("hydra.sweeper", "hydra/sweeper", "hydra/launcher",
                                         "hydra.launcher"))]
    try:
        hydra = validate.one_line(compose)(validate.selection(parsed) + own, hydra=True).hydra
    except ConfigError as e:
        hint = "; variants need hydra/sweeper=variants" if "variants" in str(e) else ""
        raise ConfigError(f"{e}{hint}") from None
    if multirun is None and str(hydra.mode) != "MULTIRUN":
        return None
    _check_launcher(hydra)
    sweeper = hydra.sweeper
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    common = params + [o.input_line for o in parsed]
    variants = list(sweeper.get("variants") or [])
    for i, variant in enumerate(variants or ([None] if params else [])):
        try:
            lines = variant_overrides(common, variant) if variant else common
            validate.check(validate.parse(lines), options, compose)
        except ConfigError as e:
            where = f"hydra.sweeper.variants[{i}] ({variant})" if variant else \
                "hydra.sweeper.params"
            raise ConfigError(f"{where}: {e}") from None
    return hydra, common, [str(v) for v in variants]


def _check_jobs(parsed: list, name: str,
                sweep: tuple[DictConfig, list[str], list[str]] | None) -> None:
    """The values of the jobs the command runs, checked as each job checks them when it starts
    (`preflight.check`), before Hydra makes a folder or the API writes one: a single run's bad
    value is one line (exit 2); a sweep is refused when every one of its jobs would be (they
    are composed in Hydra's order until one passes), while a value bad for some jobs only
    leaves their `status=error` rows and the sweep goes on. A job whose values interpolate
    Hydra's run-time settings (`${hydra:...}`) is left to itself."""
    import logging

    from memtrain import preflight
    from memtrain.config import validate

    if sweep is None:
        jobs: Iterable[list[str]] = [[o.input_line for o in parsed if not o.is_sweep_override()]]
        here = True
    else:
        hydra, common, variants = sweep
        jobs = _sweep_jobs(common, variants)
        target = str(hydra.launcher.get("_target_", ""))
        here = "Slurm" not in target.rsplit(".", 1)[-1]  # a SLURM job runs on a cluster's node
    first = None
    logging.disable(logging.WARNING)  # the checks' own warnings are the job's to log
    try:
        for lines in jobs:
            try:
                cfg = validate.one_line(
                    lambda o, **_: hydra_compose(name, o, return_hydra_config=True,
                                                 shared=True))(lines)
                if _interpolates_hydra(cfg):
                    return
                preflight.check(cfg, here)
                return
            except ConfigError as e:
                first = first or e
    finally:
        logging.disable(logging.NOTSET)
    if first is not None:
        raise first if sweep is None else ConfigError(
            f"{first} (every job of the sweep is refused: nothing would run)")


def _sweep_jobs(common: list[str], variants: list[str]) -> Iterator[list[str]]:
    """Each job's overrides, in the order Hydra's basic sweeper (and the variants sweeper,
    memtrain/config/sweeper.py) launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from memtrain.config.sweeper import variant_overrides

    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    for variant in variants or [None]:
        lines = variant_overrides(common, variant) if variant else common
        yield from BasicSweeper.split_arguments(parser.parse_overrides(lines), None)[0]


def _interpolates_hydra(cfg: DictConfig) -> bool:
    """Whether a job's options (its groups, not Hydra's node) interpolate Hydra's run-time
    settings, known only when the job runs."""
    node = OmegaConf.to_container(cfg, resolve=False)
    node.pop("hydra", None)
    return "${hydra" in json.dumps(node, default=str)


def _check_launcher(hydra: DictConfig) -> None:
    """A launcher that cannot start a job here: one line before Hydra writes anything (SLURM's
    launcher without SLURM's `sbatch` on PATH failed in submitit with a traceback, leaving a
    stray multirun.yaml)."""
    import shutil

    target = str(hydra.launcher.get("_target_", ""))
    if target.endswith(".SlurmLauncher") and shutil.which("sbatch") is None:
        raise ConfigError("hydra/launcher=slurm needs SLURM: no sbatch on PATH; run on a SLURM "
                          "login node, or use hydra/launcher=local (or parallel) on this machine")


def check_default_output_dir(overrides: list[str], multirun: bool, *,
                             config_path: str | None = None, config_dir: str | None = None,
                             config_name: str | None = None) -> None:
    """The CLI's output folder when the command does not name one (`runs/${now:...}/...`): the
    folder before its first interpolation must be one this user can make here (a read-only
    current folder, or a file named like it, gave Hydra's 24-line traceback). Nothing is made;
    call after check_overrides (the overrides are known to compose)."""
    import os

    from memtrain.config import validate

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    parsed = validate.parse(overrides)
    if any(o.key_or_group == key for o in parsed):
        return  # named on the command line: validate.check_output_dirs made and probed it
    with session(config_path, config_dir):
        cfg = hydra_compose(config_name or "config", return_hydra_config=True, shared=True,
                            overrides=[o.input_line for o in parsed if not o.is_sweep_override()])
    value = str(OmegaConf.to_container(cfg.hydra, resolve=False)[key.split(".")[1]]["dir"])
    prefix = value.split("${")[0]
    if "${" not in value:
        folder = Path(value)
    else:
        folder = Path(prefix or ".") if prefix.endswith("/") or not prefix else Path(prefix).parent
    probe = folder.expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    reason = ("a file of that name is in the way" if not probe.is_dir() else
              "no permission to write there" if not os.access(probe, os.W_OK | os.X_OK) else None)
    if reason:
        raise ConfigError(f"the output folder {value} cannot be made in {probe}: {reason}; run "
                          f"from a folder you can write to, or set {key}=PATH")


def compose(overrides: list[str] | None = None) -> tuple[DictConfig, dict[str, str]]:
    """The config the CLI would compose for these overrides (hydra node removed), and the group
    choices: Hydra's compose API over the same conf/."""

    overrides = list(overrides or [])
    check_overrides(overrides)
    with session():
        cfg = hydra_compose("config", overrides, return_hydra_config=True, shared=True)  # read
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra", None)
    return OmegaConf.create(with_hydra), choices


schema.register_configs()


# ---------------------------------------------------------------- identity


# How a run is driven, not what it computes: left out of run_id (record.DRIVING_OPTIONS).
NOT_IN_RUN_ID = record.DRIVING_OPTIONS

# Options added to an existing group choice after run_ids were frozen (tests/run_ids.json), each
# with the value that reproduces what runs did before the option existed. At that value the
# option is left out of run_id, so adding an option never renames the runs of existing configs
# (the resume and skip_done of old sweeps keep finding them); at any other value it is hashed as
# every option is. tests/test_run_ids.py fails on an option of an existing choice that is
# neither frozen nor listed here. Keys: dotted paths as on the command line ("trainer.x").
LATER_OPTIONS: dict[str, Any] = {
    # find_max_batch's margin: at these values it searches as it did before them
    "trainer.max_batch_headroom": 0.0, "trainer.max_batch_multiple": 1,
    "trainer.cuda_context_gb": 0.0,
    # what a checkpoint op plan minimises: measured times, as before the option
    "method.cost": "time", "method.checkpoint.cost": "time",
    # the checkpoint plan timed before training, as before the option
    "method.time_plan": True, "method.checkpoint.time_plan": True,
    # one run across processes: one process, as before
    "trainer.strategy": "single", "trainer.world_size": None, "trainer.fault_rank": None,
}
# Builders that moved, by the dotted path a config names them by: run_id hashes the old path,
# so runs made before the move keep their ids (skip_done finds them done)
MOVED_TARGETS = {"memtrain.data.imagefolder.": "memtrain.imagefolder.",
                 "memtrain.data.tokens.": "memtrain.tokens."}
# Trainer options that only tune a probe, left out of run_id while that probe is off: they
# change nothing else a run computes (the margin of find_max_batch on a run without it).
TUNES_PROBE = {"max_batch_headroom": "find_max_batch", "max_batch_multiple": "find_max_batch",
               "cuda_context_gb": "find_max_batch"}


def run_id(cfg: DictConfig, resolve: bool = True) -> str:
    """A hash of the resolved config (hydra's own settings and NOT_IN_RUN_ID excluded): same
    config, same id."""
    # key by key: resolving `hydra` here would recurse when its sweep subdir names the run_id
    c = {k: OmegaConf.to_container(cfg[k], resolve=resolve) if OmegaConf.is_config(cfg[k])
         else cfg[k] for k in cfg if k != "hydra"}
    offline.fill_identity(c)
    for node in c.values():
        target = node.get("_target_") if isinstance(node, dict) else None
        for new, old in MOVED_TARGETS.items():
            if isinstance(target, str) and target.startswith(new):
                node["_target_"] = old + target.removeprefix(new)
    trainer = c.get("trainer", {})
    for k in NOT_IN_RUN_ID:
        trainer.pop(k, None)
    for k, probe in TUNES_PROBE.items():
        if isinstance(trainer, dict) and not trainer.get(probe):
            trainer.pop(k, None)
    for path, default in LATER_OPTIONS.items():
        *parents, key = path.split(".")
        node = c
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node and _same(node[key], default):
            del node[key]
    # the typed trainer node (schema.Trainer) turns `8` into 8.0 in a float field: same value,
    # same id (as the YAML wrote it before the node was typed)
    for k, v in trainer.items():
        if isinstance(v, float) and v.is_integer():
            trainer[k] = int(v)
    blob = json.dumps(c, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _same(value: Any, default: Any) -> bool:
    """A value equal to an option's default, with the types a config can give it (8 == 8.0, an
    int default in a float field; True is not 1)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def _flatten(prefix: str, node: Any) -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k != "_target_":
                out.update(_flatten(f"{prefix}.{k}", v))
        return out
    if isinstance(node, list):
        return {prefix: json.dumps(node)}
    return {prefix: node}


def identity(cfg: DictConfig, choices: dict[str, str], resolve: bool = True) -> dict[str, Any]:
    """The columns that say what a run is: choices, run_id and every option flattened
    (`resolve=False`: as written, for a config whose interpolations cannot be resolved)."""
    row: dict[str, Any] = {"run_id": run_id(cfg, resolve), "status": "running"}
    row.update({g: choices.get(g) or "" for g in ("method", "model", "dataset", "optim",
                                                  "trainer", "experiment")})
    c = OmegaConf.to_container(cfg, resolve=resolve)
    offline.fill_identity(c)
    for group in ("method", "trainer", "dataset", "model", "optim"):
        row.update(_flatten(group, c.get(group, {})))
    return row
