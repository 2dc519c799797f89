"""memtrain's sweeper (`hydra/sweeper=variants`, memtrain/config/sweeper.py): Hydra takes plugin
classes from its hydra_plugins namespace only, so the class lives here, and its preset in Hydra's
ConfigStore, so it works in any Hydra app."""

# no `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, where dataclasses cannot read string annotations
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser

from memtrain.config import resolvers
from memtrain.config.sweeper import variant_overrides

__all__ = ["VariantSweeper", "VariantSweeperConf"]

resolvers.register()  # memtrain's own config names its job folders with ${memtrain_run_id:}


@dataclass
class VariantSweeperConf:
    """hydra/sweeper=variants: the basic sweeper once per variant. Each variant is a line of
    overrides (sweeps inside it expand as usual); every variant is combined with `params` and
    the command line's overrides, and a key a variant sets replaces the common one for its jobs:

        defaults: [override /hydra/sweeper: variants]          (in an experiment preset)
        hydra.sweeper.variants: ["method=none", "method=prune method.sparsity=0.5,0.9"]
    """

    _target_: str = "hydra_plugins.memtrain_sweeper.VariantSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None
    variants: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/sweeper", name="variants", node=VariantSweeperConf,
                             provider="memtrain")


class VariantSweeper(BasicSweeper):
    """The basic sweeper, once per variant (memtrain/config/sweeper.py says how). Its
    `split_arguments` is the basic sweeper's (a static method, as Hydra's); the variants replace
    the jobs that `BasicSweeper.sweep` would take from it by their own (`_jobs`), batch by
    batch."""

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 variants: list[str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.variants = [str(v) for v in variants or []]
        self._batches: list[list[list[str]]] | None = None

    def sweep(self, arguments: list[str]) -> Any:
        if self.variants:
            self._batches = self._jobs(arguments)
        return super().sweep(arguments)

    def _jobs(self, arguments: list[str]) -> list[list[list[str]]]:
        """Every variant's jobs, in batches of `max_batch_size`: each variant with the common
        overrides (`params`, then the command line's), expanded as the basic sweeper expands."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        common = [*self._parse_config(), *arguments]
        jobs: list[list[str]] = []
        for v in self.variants:
            merged = parser.parse_overrides(variant_overrides(common, v))
            jobs += BasicSweeper.split_arguments(merged, None)[0]
        return [list(c) for c in self.split_overrides_to_chunks(jobs, self.max_batch_size)]

    def get_job_batch(self) -> Sequence[Sequence[str]]:
        if self._batches is None:
            return super().get_job_batch()
        self.batch_index += 1
        return self._batches[self.batch_index - 1]

    def is_done(self) -> bool:
        if self._batches is None:
            return super().is_done()
        return self.batch_index >= len(self._batches)
