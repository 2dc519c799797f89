"""Activation checkpointing: recompute segments in backward instead of keeping their activations.

Strategies (`method.strategy`):
- `uniform`: groups of `every` consecutive segments, each group checkpointed as one unit;
- `sqrt`: groups of round(sqrt(n)) segments (Chen et al. 2016);
- `budget`: profile every segment on the run's device, then solve a 0-1 program (MONeT-style,
  scipy's HiGHS) for the least recompute time whose modelled activation peak fits the budget;
  `granularity=op` (the default) also decides per op inside recomputed groups: keep its output
  (selective checkpointing) or recompute it (`ops.py`); `block` recomputes groups whole;
- `selective`: every segment checkpointed with torch's selective activation checkpointing:
  matmul and convolution outputs saved, the cheap ops recomputed;
- `compile`: torch.compile with `torch._functorch.config.activation_memory_budget`, PyTorch's own
  budgeted rematerialisation (the peer baseline);
- `native`: the model's own checkpointing, as researchers switch it on (timm's
  `set_grad_checkpointing()`, transformers' `gradient_checkpointing_enable()`; `native.py`).

The segments are the model's chain (`memtrain/models/chain.py`): its registered rule's at
`wrap`, else found on the run's first batch in `prepare` (and on the probe's in `probe_steps`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import memtrain.methods.checkpoint.batchnorm as batchnorm
import memtrain.methods.checkpoint.cache as cache
import memtrain.methods.checkpoint.compaction as compaction
import memtrain.methods.checkpoint.native as native
import memtrain.methods.checkpoint.ops as opplan
import memtrain.methods.checkpoint.plan as planner
import memtrain.methods.common.hooks as hooks
from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.losses import cross_entropy
from memtrain.methods.base import NO_CONTEXT, MethodContext, ProbeStep, Sharding
from memtrain.methods.checkpoint.segments import Segment, apply_groups, discover
from memtrain.models.chain import registered

log = logging.getLogger("memtrain.methods.checkpoint")  # the name runs have logged under

STRATEGIES = ("uniform", "sqrt", "budget", "selective", "compile", "native")
PLANNED = ("uniform", "sqrt", "budget")
GRANULARITIES = ("op", "block")


def _save_matmul_conv(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: keep what is expensive to recompute (matmul, convolution),
    recompute the rest (normalisation, activations, pointwise ops)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    expensive = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.convolution.default, aten._convolution.default}
    return CheckpointPolicy.MUST_SAVE if op in expensive else CheckpointPolicy.PREFER_RECOMPUTE


class CompiledBudget(nn.Module):
    """torch.compile of `model`, compiled under `activation_memory_budget` = `budget`.

    Its state_dict has the plain model's keys (`conv1.weight`, not `model.conv1.weight`), as
    every other strategy's: saved weights load strictly into the model without the method, and
    resume files load back through the same hooks.
    """

    def __init__(self, model: nn.Module, budget: float):
        super().__init__()
        self.model = model
        self.budget = budget
        self.register_state_dict_post_hook(_drop_model_prefix)
        self.register_load_state_dict_pre_hook(_add_model_prefix)
        # Dynamo reuses a graph compiled for another model of the same structure (parameters are
        # graph inputs) and the budget is no part of its guards: start from empty caches.
        torch.compiler.reset()
        # Not registered as a submodule: the compiled wrapper shares model's parameters.
        object.__setattr__(self, "_compiled", torch.compile(model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch._functorch.config as fconfig
        import torch._inductor.config as inductor_config

        with fconfig.patch(activation_memory_budget=self.budget), \
                inductor_config.patch(joint_custom_pre_pass=_save_random_pass()):
            return self._compiled(x)


def _save_random(graph) -> None:
    """Mark every seeded random op of the joint graph (dropout's `rand`) MUST_SAVE. Below a
    budget of 1 the partitioner's knapsack may choose to recompute any op it bans by default,
    random ones included, and a recomputed `rand` draws a new dropout mask in backward: the
    gradients are wrong (measured on gpt_nano with dropout 0.1 at budget 1e-3: up to 0.09 off;
    tests/test_checkpoint.py, test_compile_budget_replays_dropout_masks). Saved, the random
    values are what backward reuses."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in node.target.tags:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


@functools.cache
def _save_random_pass():
    """`_save_random` as Inductor's joint-graph pre-pass, its uuid keying the compile cache
    (built on first use: importing torch._inductor takes seconds)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SaveRandom(CustomGraphPass):
        def __call__(self, graph) -> None:
            _save_random(graph)

        def uuid(self) -> str:
            return "memtrain.save_random.1"

    return SaveRandom()


def _move_keys(d: dict, src: str, dst: str) -> None:
    """In place: every key `src + rest` becomes `dst + rest`; metadata keys (module paths, no
    trailing dot) also the exact `src[:-1]` -> `dst[:-1]`."""
    for key in [k for k in d if k.startswith(src) or k == src[:-1]]:
        d[dst[:-1] if key == src[:-1] else dst + key[len(src):]] = d.pop(key)


def _drop_model_prefix(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """state_dict hook of CompiledBudget: `<prefix>model.<key>` -> `<prefix><key>`, in place
    (a nested wrapper's keys stay under its parent's prefix); the metadata (module versions)
    likewise, so the file is the plain model's state_dict."""
    _move_keys(state, prefix + "model.", prefix)
    if getattr(state, "_metadata", None) is not None:
        _move_keys(state._metadata, prefix + "model.", prefix)


def _add_model_prefix(module: nn.Module, state: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of CompiledBudget: the plain keys back under `model.` (keys
    already there, from a file saved before this hook, load as they are)."""
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix):]] = state.pop(key)
    meta = getattr(state, "_metadata", None)
    if meta is not None and inner[:-1] not in meta:
        for key in [k for k in meta if (k.startswith(prefix) or k == prefix[:-1])]:
            meta[inner[:-1] if key == prefix[:-1] else inner + key[len(prefix):]] = meta[key]


class CheckpointMethod:
    name = "checkpoint"
    grads_exact = True  # the recomputed forward is the forward

    def __init__(self, strategy: str = "budget", every: int = 1, budget_fraction: float = 0.5,
                 budget_bytes: int | None = None, max_group: int | None = None,
                 profile_batch: int | None = None, profile_repeats: int = 2,
                 dry_run: bool = False, granularity: str = "op", cost: str = "time",
                 time_plan: bool = True):
        check_choice("method.strategy", strategy, STRATEGIES)
        check_choice("method.granularity", granularity, GRANULARITIES)
        check_choice("method.cost", cost, opplan.COSTS)
        self.cost = cost  # what an op plan minimises (`ops.price`)
        # op granularity applies to the budget planner; the fixed strategies recompute whole groups
        self.by_op = granularity == "op" and strategy == "budget"
        if self.by_op and not opplan.sac_cache_is_counted():
            log.warning("checkpoint granularity=op needs selective checkpointing's cache to pass "
                        "through saved-tensor hooks (torch %s does not: what the plan keeps "
                        "would be invisible to the accounting); planning whole groups "
                        "(granularity block, the row's plan_granularity)", torch.__version__)
            self.by_op = False
        self.granularity = granularity
        check_range("method.every", every, 1)
        check_range("method.budget_fraction", budget_fraction, 0, 1, lo_open=True)
        if budget_bytes is not None:
            check_range("method.budget_bytes", budget_bytes, 1)
        if max_group is not None:
            check_range("method.max_group", max_group, 1)
        if profile_batch is not None:
            check_range("method.profile_batch", profile_batch, 1)
        self.strategy, self.every = strategy, int(every)
        self.budget_fraction, self.budget_bytes = float(budget_fraction), budget_bytes
        check_range("method.profile_repeats", profile_repeats, 1)
        self.max_group, self.profile_batch, self.dry_run = max_group, profile_batch, dry_run
        if not isinstance(time_plan, bool):
            raise ConfigError(f"method.time_plan={time_plan!r} must be true or false")
        self.time_plan = time_plan  # the plan timed against the plain model before training
        self.profile_repeats = int(profile_repeats)
        self.segments: list[Segment] = []
        self.plan: planner.Plan | None = None
        self._applied: list = []  # the CheckpointGroups of the plan in place
        self._uncompact: Callable[[], None] | None = None  # undoes the plan's compaction
        self.profile: planner.Profile | None = None
        self.ops: opplan.OpProfile | None = None
        self.raised_to: int | None = None  # the budget raised to the smallest feasible peak
        self.sharding: Sharding | None = None  # a sharded run's strategy and ranks
        # a stack's inner saved-tensor hooks, entered inside every checkpoint too (stack.py)
        self.inside: Callable[[], contextlib.AbstractContextManager] | None = None

    # ------------------------------------------------------------ wrap / prepare

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.strategy == "compile":
            return CompiledBudget(model, self.budget_fraction)
        if self.strategy == "native":
            native.enable(model)
            return model
        chain = registered(model)
        if chain is None:  # found on the run's first batch (`_find`: prepare, probe_steps)
            return model
        self.segments = chain.segments
        self._segmented(model)
        return model

    def _find(self, model: nn.Module, x: torch.Tensor) -> None:
        """The segments of a model without a registered chain, found by one traced forward of
        the batch's first samples (`memtrain/models/discover.py`), then set up as `wrap` sets
        up a registered chain's; ConfigError where the trace finds no chain."""
        if self.segments or self.strategy in ("compile", "native"):
            return
        self.segments = discover(model, x)
        self._segmented(model)

    def _segmented(self, model: nn.Module) -> None:
        if self.strategy == "budget":
            # BatchNorm as statistics + normalisation (`batchnorm.py`): an op plan keeps the
            # statistics and recomputes one elementwise pass; block plans profile the same forward
            # (one profile per sweep serves both granularities)
            batchnorm.split_batchnorms([m for s in self.segments for m in s.modules()])
        if self.strategy == "selective":
            # A saved matmul/conv output must not be overwritten later in the forward (SAC
            # checks it): in-place activations (SiLU after the squeeze-excite conv) go out-of-place.
            # (granularity=op keeps them in place: the op profile marks an output that a later op
            # overwrites as not keepable, and in place saves the unmodelled transient copy.)
            for m in model.modules():
                if isinstance(getattr(m, "inplace", None), bool):
                    m.inplace = False
            apply_groups(model, self.segments, [(i, i) for i in range(len(self.segments))],
                         policy=_save_matmul_conv, inside=self.inside)

    def check_trainer(self, trainer: Any) -> None:
        """`dry_run` plans and stops before the first step: a memory timeline of a training
        step would never be recorded, so asking for one is refused rather than ignored."""
        if self.dry_run and trainer.memory_timeline:
            raise ConfigError("trainer.memory_timeline=true with method.dry_run=true would record "
                              "no step: a dry run plans and stops before training; drop one of "
                              "them (the plan is in the log and the row's plan columns)")

    def check_strategy(self, strategy: str) -> None:
        """Under DDP or FSDP every strategy but torch.compile's runs (compiling a sharded model
        is not supported here yet: trainer.compile is refused there too)."""
        if self.strategy == "compile":
            raise ConfigError(f"method.strategy=compile with trainer.strategy={strategy}: "
                              f"compiling a DDP or FSDP model is not supported here yet; use "
                              f"method.strategy=budget (or uniform, sqrt, selective)")

    def check_stack(self, names: list[str]) -> None:
        """In a stack (methods/stack.py), what only checkpoint knows it cannot do."""
        if self.strategy == "native":
            raise ConfigError("checkpoint strategy=native is the model's own checkpointing, "
                              "which recomputes outside the other members' hooks; it stacks "
                              "with nothing (use budget, uniform, sqrt or selective)")
        if self.strategy == "compile":
            raise ConfigError("checkpoint strategy=compile lets torch.compile choose what the "
                              "whole graph saves; it stacks with nothing (use budget, uniform, "
                              "sqrt or selective)")
        # as configured (on an old torch op falls back to block)
        if self.granularity == "op" and self.strategy == "budget":
            raise ConfigError("checkpoint granularity=op plans on an operator profile of the "
                              "plain model, which the other members' saved-tensor hooks and "
                              "layers change; set method.checkpoint.granularity=block")

    def prepare(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast=None,
                carry: dict[str, Any] | None = None,
                context: MethodContext = NO_CONTEXT) -> dict[str, Any]:
        """Before the first step, on the run's first batch and device: profile the segments on
        `x`, choose the groups (or take the plan a resumed run kept in `carry`), checkpoint them
        in place; `context.cache_dir` (the sweep folder) keeps one profile per model, input,
        precision and device for every job of the sweep (`context.model_config`: the run's model
        options, part of the profile's key). Returns the plan's summary columns; with
        `dry_run`, also `dry_run=True` and `steps=0`, and the run stops there.

        `context.sharding`: a sharded run's; prepared per rank, on its batch, before the model
        is wrapped. Under FSDP a recomputed group's forward gathers the parameters of its
        segments again, one unit at a time (the last one's backward holds its own anyway): the
        planner counts what that gathers beyond the rank's shard in the group's recompute peak
        (`Profile.gathered`), so the budget holds the sharded parameter memory a plan brings
        back. FSDP's hooks run ops of their own inside a recomputed forward, where op plans
        check the op sequence: plans there are of whole groups (`plan_granularity=block`, a
        warning)."""
        self._shard(context.sharding)
        self._find(model, x)
        if self.strategy not in PLANNED:
            if self.dry_run:
                print(f"checkpoint strategy {self.strategy} has no plan to show; "
                      f"{len(self.segments)} segments")
                return {"dry_run": True, "steps": 0}
            return {}
        carry = {} if carry is None else carry
        groups, keep = carry.get("checkpoint_plan"), carry.get("checkpoint_keep")
        if groups is not None and carry.get("checkpoint_raised_to") is not None:
            self.raised_to = int(carry["checkpoint_raised_to"])  # a resumed run's kept plan
        plan = self._choose(model, x, y, autocast,
                            None if groups is None else [(int(a), int(b)) for a, b in groups],
                            None if keep is None else {(int(i), int(j)) for i, j in keep},
                            context.cache_dir,
                            [int(i) for i in carry.get("checkpoint_compact", [])],
                            context.model_config)
        self.plan = plan
        if not self.dry_run:
            self._apply(model)
            if self.strategy == "budget" and groups is None and self._stacked(model):
                self._fit_measured(model, x, y, autocast or contextlib.nullcontext)
            if self.time_plan:
                self._measure_overhead(model, x, y, autocast)
        carry["checkpoint_plan"] = [list(g) for g in self.plan.groups]
        if self.raised_to is not None:
            carry["checkpoint_raised_to"] = int(self.raised_to)
        if self.by_op:
            carry["checkpoint_keep"] = [list(k) for k in self.plan.extra["keep"]]
            carry["checkpoint_compact"] = list(self.plan.extra["compact"])
        # once, through logging: memtrain.log and the console (a dry run asks for nothing else)
        log.info("checkpoint plan (%s):\n%s", self.strategy, self.table())
        if self.dry_run:
            return {**self.summary_columns(), "dry_run": True, "steps": 0}
        return self.summary_columns()

    def _stacked(self, model: nn.Module) -> bool:
        """Other methods' saved-tensor hooks around or inside the checkpoints (a stack)."""
        return hooks.wrapped(model) or self.inside is not None

    def _fit_measured(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      autocast) -> None:
        """A stack's plan held to a measured step. The peak model counts what the segments
        save through the inner hooks, not the full-size tensors those hooks handle on the way
        (quantize packs a full tensor in forward and unpacks one in backward), so a stack's
        measured peak can pass the budget (resnet18, 16 px, checkpoint 0.5 + quantize 4 bits:
        +20%) or stay far below the model. One tracked step (profile batch, scaled) measures
        the applied plan; while it is over the budget, the model's budget is lowered by the
        excess (and further while that leaves the plan as it is: `_replan_below`) and the plan
        chosen again, at most three times; when none fits, the plan that measured least is
        kept, with a warning (`plan_budget_raised_to_bytes`: its measured peak), as a budget
        below the modelled smallest peak is raised (`_plan_budget`)."""
        scale, x, y = self._profile_slice(x, y)
        loss = lambda out: cross_entropy(out.float(), y)  # noqa: E731
        budget = target = self._target(self.profile)
        least: tuple[int, planner.Plan] | None = None
        for _ in range(4):
            measured = planner.tracked_act_peak(model, x, loss, autocast, scale)
            self.plan.extra["measured_peak"] = measured
            if least is None or measured < least[0]:
                least = (measured, self.plan)
            if measured <= budget:
                return
            got = self._replan_below(target - (measured - budget))
            if got is None:
                break
            plan, target = got
            log.info("checkpoint (stack): plan %s measured %d bytes > budget %d; re-planned "
                     "under %d modelled bytes", self.plan.groups, measured, budget, target)
            self.plan = plan
            self._apply(model)
        measured, plan = least
        base = self.profile.baseline_peak
        log.warning("checkpoint (stack): %s is below what this stack's plans measure: kept the "
                    "plan that measured least, %d bytes (budget_fraction %.3f of the modelled "
                    "baseline's %d) in a tracked step (plan_budget_raised_to_bytes)",
                    # a stack's member: its options are method.checkpoint.<option>
                    self._what(self._budget(self.profile)).replace("method.",
                                                                   "method.checkpoint.", 1),
                    measured, measured / base, base)
        self.raised_to = measured
        if plan is not self.plan:
            self.plan = plan
            self._apply(model)

    def _measure_overhead(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          autocast) -> None:
        """`plan_overhead` predicts the plan's extra step time from the recomputed forwards'
        profiled times alone; the fixed costs of checkpointing (the checkpoint machinery, its
        hooks, the extra kernel launches) are not in it and dominate a small step (resnet18 at
        16 px on a CPU, batch 8: 0.023 predicted, 0.36 measured). So the plan is also timed: the
        profile slice's forward + backward with and without it (`planner.measured_overhead`,
        max(3, profile_repeats) alternating pairs) -> `plan_measured_overhead` and
        `plan_overhead_error` (predicted - measured)."""
        _, x, y = self._profile_slice(x, y)
        loss = lambda out: cross_entropy(out.float(), y)  # noqa: E731
        self.plan.extra["measured_overhead"] = planner.measured_overhead(
            model, x, loss, autocast, lambda: self._unapply(), lambda: self._apply(model),
            max(3, self.profile_repeats))

    def _replan_below(self, target: int) -> tuple[planner.Plan, int] | None:
        """(plan, target): the block plan under `target` modelled bytes; while that is the plan
        in place (a small excess need not change it), under its modelled peak minus one byte (the
        next plan down), at most 8 times; None when no other plan fits."""
        for _ in range(8):
            try:
                plan = planner.plan_budget(self.profile, target, self.max_group)
            except planner.Infeasible:
                return None
            if plan.groups != self.plan.groups:
                return plan, target
            target = min(target, plan.peak) - 1
        return None

    def _unapply(self) -> None:
        """The plan in place undone: every module runs its own forward, uncompacted."""
        for g in self._applied:
            g.remove()
        self._applied = []
        if self._uncompact is not None:
            self._uncompact()
            self._uncompact = None

    def _apply(self, model: nn.Module) -> None:
        contexts = None
        if self.by_op:
            names = [s.name for s in self.segments]
            contexts = [p.make for p in opplan.policies(self.ops, names, self.plan.groups,
                                                        set(self.plan.extra["keep"]))]
        self._unapply()  # a plan replaced (a stack's re-plan)
        chosen = self.plan.extra.get("compact", [])
        if chosen:  # kept segments: ReLUs keep 1-bit masks, max-pools uint8 offsets (before
            # the groups take their members' forwards)
            cands = compaction.candidates(self.segments)
            self._uncompact = compaction.apply([m for i in chosen for m in cands[i]])
        self._applied = apply_groups(model, self.segments, self.plan.groups, contexts=contexts,
                                     inside=self.inside)

    def _choose(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast,
                groups: list[tuple[int, int]] | None = None,
                keep: set[tuple[int, int]] | None = None,
                cache_dir: Path | None = None, compact: list[int] | None = None,
                model_config: Mapping[str, Any] | None = None) -> planner.Plan:
        """Profile the segments on `x` and choose the groups (`groups`, `keep`, `compact`: a
        plan kept by a resumed run, used whatever a new profile says); sets `self.profile` (and
        `self.ops`)."""
        scale, x, y = self._profile_slice(x, y)
        self._profile(model, x, y, autocast or contextlib.nullcontext, scale, cache_dir,
                      model_config)
        prof, n = self.profile, self.profile.n
        if self.by_op and groups is not None:
            return opplan.op_plan(prof, self.ops, groups, keep or set(), compact or ())
        if groups is not None:
            return planner.make_plan(prof, groups)
        if self.strategy == "uniform":
            return planner.make_plan(prof, planner.uniform_groups(n, self.every))
        if self.strategy == "sqrt":
            return planner.make_plan(prof, planner.uniform_groups(n, max(1, round(math.sqrt(n)))))
        return self._plan_budget(prof)

    def _profile_slice(self, x: torch.Tensor, y: torch.Tensor
                       ) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(scale, x, y): the first `profile_batch` samples and the factor back to the batch."""
        pb = self.profile_batch
        if pb is not None and pb < x.shape[0]:
            return x.shape[0] / pb, x[:pb], y[:pb]
        return 1.0, x, y

    def _profile(self, model, x, y, autocast, scale: float, cache_dir: Path | None,
                 model_config: Mapping[str, Any] | None = None) -> None:
        """Sets `self.profile` (and `self.ops` at op granularity): from the sweep's cache, or
        measured on `x` (and then cached). Op and block jobs of a sweep share the segment
        profile; the first op job adds the op profile to it."""
        k, got = None, None
        stacked = self._stacked(model)
        # a probe's fake tensors: every pass gives the same bytes and FLOPs, and no time
        repeats = 1 if is_fake(x) else self.profile_repeats
        if cache_dir is not None and not stacked:  # a stack's hooks are not in the cache key
            # bn: BatchNorm split into statistics + normalisation (`batchnorm.py`); profiles of
            # the one-op forward (before it) list other ops and must not be reused
            # compact: op profiles carry the compaction choices (`compact.py`); ops=2: each
            # op's FLOPs and bytes moved kept beside its time, priced after loading
            # (`ops.price`, method.cost), where older profiles kept one priced cost
            k = cache.key(model, [s.name for s in self.segments], x, autocast, scale=scale,
                          repeats=self.profile_repeats, bn="split", compact=1, ops=2,
                          transient=3, held=1, model_options=model_config)
            got = cache.load(cache_dir, k)
        if got is None:
            loss = lambda out: cross_entropy(out.float(), y)  # noqa: E731
            self.profile, ops = planner.profile(model, self.segments, x, loss, autocast,
                                                repeats, scale), None
            if hooks.wrapped(model) and self.inside is None:
                # stacked around hooks that are off when backward recomputes (offload's)
                with hooks.suspended():
                    self.profile.recompute = planner.profile(model, self.segments, x, loss,
                                                             autocast, 1, scale).inner
        else:
            self.profile, ops = got
        self.profile.gathered = self._gathered()
        if self.by_op and ops is None:
            ops = opplan.profile_model(model, self.segments, x, autocast, repeats, scale)
            ops.compact = compaction.profile(model, self.segments, x, autocast, repeats, scale,
                                             self.profile, ops)
            opplan.calibrate(ops, self.profile.time)
        if k is not None and (got is None or (got[1] is None and ops is not None)):
            cache.save(cache_dir, k, self.profile, ops)
        if ops is not None:  # a probe's clock means nothing: there time is the roofline
            opplan.price(ops, "roofline" if self.cost == "time" and is_fake(x) else self.cost,
                         x.device.type)
        self.ops = ops if self.by_op else None

    def _shard(self, sharding: Sharding | None) -> None:
        """A sharded run's (strategy, world size), before anything is planned (`prepare`)."""
        if sharding is not None and sharding[0] == "fsdp" and self.by_op:
            log.warning("checkpoint granularity=op under trainer.strategy=fsdp: FSDP's hooks run "
                        "ops of their own inside a recomputed forward, where an op plan checks "
                        "the sequence of ops; planning whole groups (granularity block, the "
                        "row's plan_granularity)")
            self.by_op = False
        self.sharding = sharding

    def _gathered(self) -> list[int]:
        """Per segment, the parameter bytes an FSDP rank gathers beyond its shard to run the
        segment's forward (N - 1 of N parts); [] unless sharded by FSDP."""
        if getattr(self, "sharding", None) is None or self.sharding[0] != "fsdp":
            return []
        n = self.sharding[1]
        return [sum(p.numel() * p.element_size() for m in seg.modules() for p in m.parameters())
                * (n - 1) // n for seg in self.segments]

    def probe_steps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, autocast,
                    num_classes: int, context: MethodContext = NO_CONTEXT) -> list[ProbeStep]:
        """For the probes (`estimate.probe_steps`): the step a run measures, the plan that
        `prepare` would choose on this batch applied (profiled on the probe's own batch: on fake
        tensors bytes and FLOPs are exact, times meaningless: block plans minimise FLOPs, op
        plans the roofline there, where a run's op plans minimise measured times; both hold
        the same budget, so the estimate's plan peaks where the run's does, not always by the
        same ops). `context.sharding`: one rank of a sharded run, planned as its `prepare`
        plans; the probe neither reads nor writes the sweep's profile cache."""
        self._shard(context.sharding)
        self._find(model, x)
        if self.strategy in PLANNED:
            self.plan = self._choose(model, x, y, autocast)
            self._apply(model)
        return [ProbeStep(model, x, y)]

    def _budget(self, prof: planner.Profile) -> int:
        """The budget asked for (`plan_budget_bytes`)."""
        if self.budget_bytes is not None:
            return int(self.budget_bytes)
        return int(self.budget_fraction * prof.baseline_peak)

    def _target(self, prof: planner.Profile) -> int:
        """The budget the plan is held to: the one asked for, or the smallest feasible peak it
        was raised to (`_plan_budget`)."""
        return self.raised_to if self.raised_to is not None else self._budget(prof)

    def _what(self, budget: int) -> str:
        return (f"method.budget_bytes={self.budget_bytes}" if self.budget_bytes is not None
                else f"method.budget_fraction={self.budget_fraction} ({budget} bytes)")

    def _plan_budget(self, prof: planner.Profile) -> planner.Plan:
        """The plan of least recompute under the budget; a budget below the smallest feasible
        activation peak is raised to that peak, with a warning, and the row says so
        (`plan_budget_raised_to_bytes`): one default budget then runs on every model (0.5 is
        below mlp6's smallest feasible peak, 0.615 of its baseline's at batch 128, 32 px)."""
        budget = self._budget(prof)
        self.raised_to = None
        plan = lambda b: (opplan.plan_budget(prof, self.ops, b, self.max_group)  # noqa: E731
                          if self.by_op else planner.plan_budget(prof, b, self.max_group))
        try:
            return plan(budget)
        except planner.Infeasible as e:
            least = e.min_peak
        log.warning("checkpoint: %s is below the smallest feasible activation peak, %d bytes "
                    "(budget_fraction %.3f of the baseline's %d): planned at that peak instead "
                    "(plan_budget_raised_to_bytes)", self._what(budget), least,
                    least / prof.baseline_peak, prof.baseline_peak)
        self.raised_to = least
        return plan(least)

    def summary_columns(self) -> dict[str, Any]:
        p, prof = self.plan, self.profile
        if p is None or prof is None:
            return {}
        return {
            "plan_peak_bytes": p.peak,
            "plan_baseline_peak_bytes": prof.baseline_peak,
            "plan_budget_bytes": self._budget(prof) if self.strategy == "budget" else None,
            **({"plan_budget_raised_to_bytes": self.raised_to}
               if self.strategy == "budget" and self.raised_to is not None else {}),
            "plan_overhead": p.overhead,
            # the same plan timed before training (_measure_overhead); absent in a dry run
            **({"plan_measured_overhead": p.extra["measured_overhead"],
                "plan_overhead_error": p.overhead - p.extra["measured_overhead"]}
               if "measured_overhead" in p.extra else {}),
            "plan_recompute_s": p.recompute_s,
            "plan_segments": prof.n,
            "plan_groups": ";".join(f"{a}-{e}" for a, e in p.groups),
            "plan_solve_s": p.extra.get("solve_s", 0.0),
            # a stack's plan, measured in one tracked step before training (_fit_measured)
            **({"plan_measured_peak_bytes": p.extra["measured_peak"]}
               if "measured_peak" in p.extra else {}),
            "plan_granularity": "op" if self.by_op else "block",
            **({"plan_kept_ops": len(p.extra["keep"]),
                "plan_recomputed_ops": sum(len(self.ops.ops[i]) for a, e in p.groups
                                           for i in range(a, e + 1)) - len(p.extra["keep"]),
                "plan_compact_segments": len(p.extra["compact"]),
                "plan_compact_bytes": sum(c.saves for c in self._compacted())}
               if self.by_op else {}),
        }

    def plan_rows(self, model: nn.Module) -> list[dict[str, Any]]:
        """The plan in place, one row per segment (memory/by_module.py's plan.csv): its modules
        (as `model.named_modules()` names them), kept or recomputed and in which group, and at
        op granularity the ops of a recomputed segment whose outputs the plan keeps (and their
        bytes) and a kept segment's compaction. `selective`: every segment recomputed as a
        group of its own, matmul and convolution outputs kept; `compile` has no plan (torch
        decides inside the compiled graph): no rows."""
        if self.strategy == "compile" or not self.segments:
            return []
        names = {id(m): n for n, m in model.named_modules()}
        if self.strategy == "selective":
            groups, keep, ops = [(i, i) for i in range(len(self.segments))], set(), None
        elif self.plan is not None:
            groups, ops = self.plan.groups, self.ops
            keep = set(self.plan.extra.get("keep", ())) if self.by_op else set()
        else:
            return []
        group_of = {i: g for g in groups for i in range(g[0], g[1] + 1)}
        compact = set(self.plan.extra.get("compact", ())) if self.plan is not None else set()
        rows = []
        for i, seg in enumerate(self.segments):
            g = group_of.get(i)
            row: dict[str, Any] = {
                "segment": i, "name": seg.name,
                "modules": " ".join(names.get(id(m), seg.name) for m in seg.modules()),
                "decision": "keep" if g is None else "recompute",
                "group": "" if g is None else f"{g[0]}-{g[1]}", "compact": i in compact}
            if ops is not None and g is not None:
                kept = [o for j, o in enumerate(ops.ops[i]) if (i, j) in keep]
                row.update(ops=len(ops.ops[i]), kept_ops=len(kept),
                           kept_bytes=sum(o.nbytes for o in kept))
            rows.append(row)
        return rows

    def _compacted(self) -> list[opplan.Compact]:
        chosen = set(self.plan.extra.get("compact", []))
        return [c for c in self.ops.compact if c.seg in chosen]

    def table(self) -> str:
        """The profile and the plan, one row per segment (what `dry_run` prints)."""
        prof, p = self.profile, self.plan
        group_of = {i: g for g in p.groups for i in range(g[0], g[1] + 1)}
        # the unit that shows the largest segment with 1-4 integer digits: small models in KiB
        biggest = max([*prof.inner, *prof.out, 1])
        unit, scale = next((u, 2**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10), ("B", 0))
                           if biggest >= 2**e)
        lines = [f"{'#':>3} {'segment':<14} {'inner ' + unit:>10} {'out ' + unit:>9} "
                 f"{'fwd ms':>8}  decision"]
        compact = {c.seg: c for c in self._compacted()} if self.by_op else {}
        for i in range(prof.n):
            g = group_of.get(i)
            what = "keep" if g is None else (f"recompute (group {g[0]}-{g[1]})")
            if i in compact:
                c = compact[i]
                what += (f", compact ({c.what}: -{c.saves / scale:.2f} {unit}, "
                         f"+{c.time * 1e3:.2f} ms)")
            lines.append(f"{i:>3} {prof.names[i]:<14} {prof.inner[i] / scale:>10.2f} "
                         f"{prof.out[i] / scale:>9.2f} {prof.time[i] * 1e3:>8.2f}  {what}")
        if not any(prof.inner):
            lines.append("inner 0 in every segment: each saves only its input and output (e.g. "
                         "Linear + ReLU), so recomputing one frees its output only")
        lines.append(f"tail (kept): {prof.tail / scale:.2f} {unit}; baseline step "
                     f"{prof.step_time * 1e3:.1f} ms")
        lines.append(f"activation peak: baseline {prof.baseline_peak / scale:.2f} {unit} -> plan "
                     f"{p.peak / scale:.2f} {unit} ({p.peak / prof.baseline_peak:.3f}x); predicted "
                     f"overhead +{100 * p.overhead:.1f}% step time")
        if self.by_op:
            offered = ", ".join(f"{prof.names[c.seg]} -{c.saves / scale:.2f} {unit}"
                                for c in self.ops.compact) or "none in this model"
            lines.append(f"compaction choices (lossless: ReLU 1-bit masks, max-pool uint8 "
                         f"offsets): {offered}; chosen: "
                         f"{', '.join(prof.names[i] for i in sorted(compact)) or 'none'}")
            lines.append("ops (granularity op; keep = output cached by selective checkpointing):")
            lines += ["  " + ln for ln in opplan.describe(self.ops, p.groups,
                                                          set(p.extra["keep"]))]
        if "solve_s" in p.extra:
            lines.append(f"solve time {p.extra['solve_s']:.2f} s")
        return "\n".join(lines)
