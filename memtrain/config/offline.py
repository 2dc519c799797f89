"""Models by name never fetch anything: the rule a by-name model's config is held to.

timm, torchvision and transformers each load weights or code when asked (`pretrained=True`,
`checkpoint_path=...`, `weights=...`, an `hf-hub:` name, `trust_remote_code=True`, ...).
memtrain builds their architectures with random weights only, offline, so every key that
downloads or loads a file, and every name that is a hub address, a URL or a path, is refused in
one line: before Hydra starts (validate.check_targets, with the composed config and each value
of a sweep) and again where the builder runs (the Python API, a launcher's job). Nothing here
imports a library: the checks read strings.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memtrain.errors import ConfigError

# Keys that fetch or load weights, code or files in timm (create_model, build_model_with_cfg),
# torchvision (get_model) or transformers (configs and from_pretrained's keyword arguments).
FETCHING = frozenset({
    "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "pretrained_strict",
    "checkpoint_path", "checkpoint_filter_fn", "weights", "weights_backbone", "cache_dir",
    "trust_remote_code", "local_files_only", "revision", "code_revision", "token",
    "use_auth_token", "force_download", "resume_download", "proxies", "subfolder", "auto_map",
    "name_or_path", "_name_or_path", "pretrained_model_name_or_path", "adapter_name_or_path",
    "gguf_file", "variant", "use_safetensors", "from_tf", "from_flax", "state_dict",
    "quantization_config", "hub_kwargs", "model_args",
})
# ... and any key that holds one of these words (a file, a URL, a hub, a download)
FETCHING_PARTS = ("pretrained", "checkpoint_path", "url", "hub", "download", "remote", "file",
                  "cache_dir", "name_or_path")
# Values that name something to fetch: hub addresses and URLs
FETCHING_VALUES = re.compile(r"^\s*(hf[-_]hub:|hf:|https?:|s?ftp:|file:|s3:|gs:|timm/)", re.I)
# A registry name: letters, digits, _ - . (timm's tags: resnet50.a1_in1k); never a path
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def fetching_key(key: str) -> bool:
    """A keyword argument or config key that fetches or loads something."""
    k = str(key).strip().lower()
    return k in FETCHING or any(p in k for p in FETCHING_PARTS)


def refusal(where: str, value: Any) -> str | None:
    """The one-line reason a value at key path `where` (`model.kwargs.pretrained`) may not be
    given to a by-name builder, or None. Walks mappings and lists."""
    key = where.rsplit(".", 1)[-1]
    if where.count(".") >= 2 and fetching_key(key):  # model.<node>.<key>: kwargs or config
        return (f"{where}={value}: memtrain builds models offline with random weights and never "
                f"loads weights, code or files (a by-name model's '{key}' would); remove it")
    if isinstance(value, dict):
        for k, v in value.items():
            msg = refusal(f"{where}.{k}", v)
            if msg:
                return msg
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            msg = refusal(f"{where}[{i}]", v)
            if msg:
                return msg
    elif isinstance(value, str) and FETCHING_VALUES.match(value):
        return (f"{where}={value}: a hub address or URL; memtrain builds models offline from a "
                f"library's registry by name, never from a hub or a file")
    elif isinstance(value, float) and not math.isfinite(value):
        return f"{where} must be a finite number, got {value}"
    return None


def check_name(where: str, name: Any, library: str) -> str:
    """A registry name, never a hub address, URL or path; returns it stripped."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where} must name a {library} model, got {name!r}")
    name = name.strip()
    if FETCHING_VALUES.match(name) or not NAME.match(name) or ".." in name:
        raise ConfigError(f"{where}={name}: a name from {library}'s registry, never a hub "
                          f"address, URL or path (memtrain builds models offline with random "
                          f"weights; nothing is downloaded or loaded)")
    return name


def check_node(node: Any, where: str = "model") -> None:
    """Every key and value of a composed model node (a by-name model's `name`, its `kwargs`,
    its `config`): ConfigError on the first that would fetch something."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key == "_target_":
            continue
        path = f"{where}.{key}"
        if key == "name" and isinstance(value, str) and "${" not in value \
                and str(node.get("_target_")).split(".")[-1] in BY_NAME:
            check_name(path, value, BY_NAME[node["_target_"].split(".")[-1]])
            continue
        if where.count(".") == 0 and fetching_key(key):
            raise ConfigError(f"{path}={value}: memtrain builds models offline with random "
                              f"weights and never loads weights, code or files; remove it")
        msg = refusal(path, value)
        if msg:
            raise ConfigError(msg)


# the by-name builders (memtrain.models.<function>) and the library whose registry they read
BY_NAME = {"timm_model": "timm", "torchvision_model": "torchvision", "hf_model": "transformers"}
ENV_MODEL = "MEMTRAIN_MODEL"  # memtrain/models/user.py: names code to run; only a shell sets it
USER_MODULE = "memtrain.models.user_module"  # model=module


def check_command(container: dict[str, Any], swept: list[tuple[str, list[Any]]]) -> None:
    """What a command builds, before Hydra starts: the composed model node (check_node), the
    by-name model's name in its library's registry (importing the library: the job would
    import it next), each value of a sweep over a model key (`swept`: (key, values)), and no
    `hydra.job.env_set` that names the user's module (MEMTRAIN_MODEL)."""
    env = ((container.get("hydra") or {}).get("job") or {}).get("env_set") or {}
    if ENV_MODEL in env:
        raise ConfigError(f"hydra.job.env_set.{ENV_MODEL}={env[ENV_MODEL]}: a config may not "
                          f"name code to run; set {ENV_MODEL} in the shell that starts memtrain "
                          f"(docs/SECURITY.md)")
    node = container.get("model")
    check_node(node)
    builder = str((node or {}).get("_target_", "")).split(".")[-1]
    names = [(node or {}).get("name")]
    for key, values in swept:
        for value in values:
            msg = refusal(key, value) if key.count(".") >= 2 else None
            if msg:
                raise ConfigError(msg)
            if key.split(".")[-1] in FETCHING or fetching_key(key.split(".")[-1]):
                raise ConfigError(f"{key}: memtrain builds models offline with random weights "
                                  f"and never loads weights, code or files; remove it")
            if key == "model.name":
                names.append(value)
    if builder in BY_NAME:
        for name in names:
            if isinstance(name, str) and "${" not in name:
                precheck(str(node["_target_"]), {**node, "name": name})


def precheck(target: str, node: dict[str, Any]) -> None:
    """What a by-name builder checks before it builds (its name in the library's registry, the
    keys the run sets itself, transformers' sizes), on a composed node: ConfigError. The checks
    are the builder's own (its `precheck` attribute), found through its `_target_` as the run
    would build it."""
    from memtrain.config import trust

    check = getattr(trust.locate(target, "model._target_"), "precheck", None)
    resolved = {k: v for k, v in node.items() if k != "_target_"}
    if check is not None and not any(isinstance(v, str) and "${" in v
                                     for v in _leaves(resolved)):
        check(resolved)


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _leaves(v)]
    if isinstance(node, list):
        return [x for v in node for x in _leaves(v)]
    return [node]


def offline() -> None:
    """Tell the hub clients to stay offline (belt and braces: nothing asks them to fetch)."""
    os.environ.update(OFFLINE_ENV)


def unknown(where: str, name: str, known: Iterable[str], library: str, how: str) -> ConfigError:
    """`where=name` is not in `known`: one line with the closest names of the registry."""
    names = sorted(set(known))
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    if not close:  # a prefix or a family name: the registry's names that start with it
        close = [n for n in names if n.startswith(name.split("_")[0])][:5]
    hint = f"; closest: {', '.join(close)}" if close else ""
    return ConfigError(f"{where}={name}: no such model in {library} ({len(names)} names, "
                       f"{how}){hint}")


def check_kwargs(where: str, kwargs: Any, reserved: dict[str, str]) -> dict[str, Any]:
    """A by-name model's keyword arguments as a plain dict: nothing that fetches, no key the
    run sets itself (`reserved`: key -> where it comes from), every number finite."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{where} must be a mapping such as {{drop_rate: 0.1}}, got {kwargs!r}")
    for key, value in kwargs.items():
        if key in reserved:
            raise ConfigError(f"{where}.{key}: set by the run ({reserved[key]}); remove it")
        if fetching_key(key):
            raise ConfigError(f"{where}.{key}={value}: memtrain builds models offline with "
                              f"random weights and never loads weights, code or files; remove "
                              f"it")
        msg = refusal(f"{where}.{key}", value)
        if msg:
            raise ConfigError(msg)
    return dict(kwargs)


def env_identity() -> tuple[str, str] | None:
    """(name, arch) of the factory MEMTRAIN_MODEL names, without running it: the factory's
    name and a hash of the spec and its source file's bytes; None when unset."""
    spec = os.environ.get(ENV_MODEL)
    if not spec:
        return None
    where, _, attr = spec.rpartition(":")
    h = hashlib.sha1(spec.encode())
    path = Path(where).expanduser() if where.endswith(".py") else None
    if path is None and where:
        try:
            found = importlib.util.find_spec(where)
            path = Path(found.origin) if found and found.origin else None
        except (ImportError, ValueError):
            path = None
    if path is not None and path.is_file():
        h.update(path.read_bytes())
    return attr or spec, h.hexdigest()[:12]


def fill_identity(c: dict[str, Any]) -> None:
    """A composed config (a plain dict) of `model=module` without `model.arch`: name and arch
    from MEMTRAIN_MODEL, so the run_id tells two factories apart (loader.run_id)."""
    node = c.get("model")
    if not isinstance(node, dict) or node.get("_target_") != USER_MODULE or node.get("arch"):
        return
    found = env_identity()
    if found is not None:
        node["name"], node["arch"] = node.get("name") or found[0], found[1]
