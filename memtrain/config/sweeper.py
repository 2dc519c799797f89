"""`hydra/sweeper=variants`: a baseline and a method's variants in one multirun, one folder.

Hydra's basic sweeper takes the cartesian product of its parameters, so `method=none,prune
method.sparsity=0.5,0.9` cannot be one sweep (none has no sparsity). `VariantSweeper` is the basic
sweeper with a list of variants: each is a line of overrides (sweeps allowed inside it, expanded
as the basic sweeper expands them) and every variant is combined with the sweep's common
parameters (`hydra.sweeper.params` and the command line's overrides). A key a variant sets
replaces the same key of the common parameters for that variant's jobs:

    defaults:
      - override /hydra/sweeper: variants
    hydra:
      sweeper:
        params: {trainer.seed: 0,1}
        variants:
          - method=none
          - method=prune method.sparsity=0.5,0.9 method.block_size=16,32

gives 2 x (1 + 4) = 10 jobs. Without variants it is the basic sweeper. Hydra accepts sweepers from
its `hydra_plugins` namespace only: the class is `memtrain/hydra_plugins/memtrain_sweeper`'s
`VariantSweeper`, whose module also puts the `variants` preset in Hydra's ConfigStore (any Hydra
app can sweep so). This module keeps what the sweeper and the checks share.
"""

from __future__ import annotations

import shlex

from hydra.core.override_parser.overrides_parser import OverridesParser


def variant_overrides(common: list[str], variant: str) -> list[str]:
    """The override strings of one variant: the common ones whose key the variant does not set,
    then the variant's own (a line of overrides, shell-quoted as on a command line)."""
    parser = OverridesParser.create()
    own = parser.parse_overrides(shlex.split(variant))
    keys = {o.get_key_element() for o in own}
    kept = [o for o in parser.parse_overrides(common) if o.get_key_element() not in keys]
    return [o.input_line for o in kept] + [o.input_line for o in own]
