"""Where memtrain's own files are: conf/ of a source checkout, else the installed memtrain.conf.

Imports the standard library only: config/loader.py (Hydra's search path) and the report (its
display names and method order in conf/report/) both read conf/ through it.
"""

from __future__ import annotations

from pathlib import Path


def conf_dir() -> Path:
    """conf/ beside the package in a source checkout, else the installed memtrain.conf."""
    here = Path(__file__).resolve().parent.parent / "conf"
    if (here / "config.yaml").exists():
        return here
    return installed_conf_dir()


def installed_conf_dir() -> Path:
    """The folder of the installed `memtrain.conf` (a package: its one folder is its path)."""
    import memtrain.conf

    return Path(next(iter(memtrain.conf.__path__)))
