"""memtrain's sweeper (`hydra/sweeper=variants`, memtrain/sweeper.py): Hydra takes plugin classes
from its hydra_plugins namespace only, so the class lives here."""

from __future__ import annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override

from memtrain.sweeper import variant_overrides

__all__ = ["VariantSweeper"]


class VariantSweeper(BasicSweeper):
    """The basic sweeper, once per variant (memtrain/sweeper.py says how)."""

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 variants: list[str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.variants = [str(v) for v in variants or []]

    def split_arguments(self, overrides: list[Override],  # type: ignore[override]
                        max_batch_size: int | None) -> list[list[list[str]]]:
        if not self.variants:
            return BasicSweeper.split_arguments(overrides, max_batch_size)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        common = [o.input_line for o in overrides]
        jobs = []
        for v in self.variants:
            merged = parser.parse_overrides(variant_overrides(common, v))
            jobs += BasicSweeper.split_arguments(merged, None)[0]
        return [list(c) for c in BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size)]

