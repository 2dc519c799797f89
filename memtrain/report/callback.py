"""Hydra callback: at the end of every multirun, the report of the sweep into its folder.

Registered in conf/config.yaml under `hydra.callbacks.report`, so `memtrain -m ...` leaves
summary.csv, report.md and figures/ beside the job folders. A failing report is logged, never
raised: the runs are already on disk and `memtrain-report DIR` can redo it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger("memtrain.report")


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


class ReportCallback(Callback):
    """Runs `make_report(sweep dir)` in on_multirun_end; the keyword arguments are its options
    (see `memtrain-report --help`)."""

    def __init__(self, enabled: bool = True, baseline: str = "method=none",
                 match: list[str] | None = None, formats: list[str] | None = None,
                 memory: str = "auto", style: str = "paper",
                 names: Any = None) -> None:
        self.enabled = enabled
        self.options = {"baseline": baseline, "memory": memory, "style": style}
        if names:  # a YAML file or a mapping (report/names.py); OmegaConf nodes become dicts
            self.options["names"] = names if isinstance(names, str) else _plain(names)
        if match:
            self.options["match"] = list(match)
        self.options["formats"] = list(formats or ("png", "pdf"))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            sweep = Path(str(config.hydra.sweep.dir))
            from memtrain.report.build import make_report

            rep = make_report([sweep], sweep, **self.options)
            log.info("report: %d runs, %d settings -> %s (figures: %s)", len(rep.runs),
                     len(rep.settings), rep.out / "report.md", ", ".join(rep.figures) or "none")
        except Exception as e:  # the sweep's runs matter more than its report
            log.warning("report of the sweep failed (%s: %s); run memtrain-report on the sweep "
                        "folder to retry", type(e).__name__, e, exc_info=True)
