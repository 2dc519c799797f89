"""One run across processes (run/distributed.py): DDP and FSDP2 on torchrun, per-rank memory.

What one rank holds is counted in this process on torch's fake process group (one rank of N,
collectives that move nothing); the two real 2-rank runs (torchrun, gloo) are marked `ranks`
and run alone (tests/conftest.py), one per strategy.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import run_memtrain, warm_python
from torch import nn

from memtrain import api
from memtrain.errors import ConfigError
from memtrain.memory import measure
from memtrain.models.mlp import mlp6
from memtrain.optim import build_optimizer
from memtrain.run import distributed

TINY = ["model=mlp6", "trainer=smoke", "dataset.image_size=8", "model.widths=[64,64,64,64,64]"]


def torchrun(*args: str, cwd: Path, ranks: int = 2, timeout: float = 600,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS -m memtrain ARGS`, as a user runs it; the
    agent and, through torchrun's own `PYTHON_EXEC`, every rank forked from the worker's warm
    interpreter (conftest.warm_python) where it can."""
    scratch = cwd.parent / f"{cwd.name}-tmp"  # torchrun's own folders (and a killed rank's)
    scratch.mkdir(exist_ok=True)  # in the test's temporary tree, not the machine's /tmp
    full = {"OMP_NUM_THREADS": "1", "PYTHON_EXEC": warm_python(), "TMPDIR": str(scratch),
            **(env or {})}
    return run_memtrain("--standalone", f"--nproc-per-node={ranks}", "-m", "memtrain", *args,
                        cwd=cwd, timeout=timeout, env=full, module="torch.distributed.run")


def _rank_step(overrides: list[str], strategy: str, ranks: int = 2, steps: int = 3) -> dict:
    """One rank's accounting step of the run the overrides describe, as the runner prepares
    and wraps it (the method prepared on the rank's batch, then DDP or FSDP's shards) and as
    its loop measures it (measure.Measurement), on the fake process group of `ranks` ranks for
    ddp and fsdp: the row's memory columns of that rank (single: one process on that batch)."""
    import contextlib

    import memtrain.methods.base as base
    from memtrain.run import runner
    from memtrain.run.train import autocast_factory

    cfg, _ = api.compose(overrides)
    t = runner.trainer_of(cfg)
    cpu = torch.device("cpu")
    _, model, method = runner.build(cfg, t)
    torch.manual_seed(0)
    x = torch.randn(t.batch_size // ranks, 3, cfg.dataset.image_size, cfg.dataset.image_size)
    y = torch.randint(0, 10, (x.shape[0],))
    context = base.MethodContext(
        sharding=base.Sharding(strategy, ranks) if strategy != "single" else None)
    base.prepare(method, model, x, y, autocast_factory("cpu", "fp32"), {}, context)
    session = distributed.fake_session(strategy, ranks) if strategy != "single" else \
        contextlib.nullcontext(distributed.World())
    with session as world:
        model = distributed.wrap(model, world, cpu)
        opt = build_optimizer(model, **runner.kwargs_of(cfg.optim))
        summary: dict = {}
        meas = measure.Measurement(cpu, steps, 1, True, summary,
                                   settle=distributed.settle_steps(model))
        for step in range(steps):
            with meas.step(step, model, opt, x, y):
                with meas.forward():
                    loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                meas.updating()
                opt.step()
                meas.update_done(model)
                opt.zero_grad(set_to_none=True)
        return summary


def _steps(strategy: str, optim: str, ranks: int = 2) -> dict:
    """`_rank_step` of TINY's mlp6 with `optim` (no weight decay: its state is what ZeRO counts)
    on the local batch of `ranks` ranks (one process: the same batch)."""
    return _rank_step([*TINY, f"optim={optim}", "optim.weight_decay=0.0"], strategy, ranks)


@pytest.mark.compat
@pytest.mark.parametrize("optim,k", [("sgd", 4), ("adamw", 8)])
@pytest.mark.slow
def test_model_state_per_rank_follows_zero(optim, k):
    """Rajbhandari et al.'s accounting, fp32: parameters (4 bytes each) + gradients (4) +
    optimizer state (K: SGD's momentum 4, AdamW's two moments 8), divided by N under stage 3
    (FSDP), whole on every rank under DDP (stage 0), counted from the model's parameter count,
    not from a run; each rank's measured columns within 5%."""
    psi = sum(p.numel() for p in mlp6(10, (3, 8, 8), widths=[64] * 5).parameters())
    assert psi == 29642  # 192*64 + 64 + 4 * (64*64 + 64) + 64*10 + 10: the model counted
    for strategy, ranks, share in (("single", 1, 1), ("ddp", 2, 1), ("fsdp", 2, 2),
                                   ("fsdp", 4, 4)):
        row = _steps(strategy, optim, ranks)
        state = row["mem_params_bytes"] + row["mem_grads_bytes"] + row["mem_optim_bytes"]
        assert state == pytest.approx((4 + 4 + k) * psi / share, rel=0.05), (strategy, ranks)
        assert row["mem_params_bytes"] == pytest.approx(4 * psi / share, rel=0.05)
        # DDP's reducer holds a second copy of every gradient, as its buckets: in the peak
        assert row.get("mem_comm_buffers_bytes", 0) == (4 * psi if strategy == "ddp" else 0)


@pytest.mark.compat
def test_sharding_changes_no_activation():
    """The activation figures of a rank's step are its local batch's, whatever holds the
    parameters: FSDP's gathered copies and its all-gather buffers are no activation memory."""
    rows = {s: _steps(s, "sgd") for s in ("single", "ddp", "fsdp")}
    for s in ("ddp", "fsdp"):
        assert rows[s]["mem_act_saved_bytes"] == rows["single"]["mem_act_saved_bytes"]
        assert rows[s]["mem_peak_act_bytes"] == pytest.approx(
            rows["single"]["mem_peak_act_bytes"], rel=0.02), s
        assert rows[s]["mem_peak_act_temp_bytes"] == pytest.approx(
            rows["single"]["mem_peak_act_temp_bytes"], rel=0.02), s


RESNET = ["model=resnet18", "dataset.image_size=16", "trainer=smoke", "trainer.max_steps=3",
          "dataset.train_size=24"]


@pytest.mark.slow
@pytest.mark.compat
def test_checkpoint_under_fsdp_lowers_each_ranks_activation_peak():
    """checkpoint under fsdp on resnet18 at 2 ranks: its plan (whole groups, the parameters a
    recompute gathers again in the budget) lowers one rank's activation peak below none's under
    fsdp, and each rank still holds half the model state (planned on the rank's batch of 4)."""
    none = _rank_step(RESNET, "fsdp")
    ckpt = _rank_step([*RESNET, "method=checkpoint"], "fsdp")
    assert ckpt["mem_peak_act_bytes"] < 0.6 * none["mem_peak_act_bytes"]
    assert ckpt["mem_act_saved_bytes"] < none["mem_act_saved_bytes"]
    assert ckpt["mem_params_bytes"] == none["mem_params_bytes"]


@pytest.mark.slow
def test_checkpoint_under_fsdp_changes_no_gradient(in_tmp):
    """The same plan's gradients are none's: resnet18 under fsdp on a real (gloo) group of one
    rank in this process, FSDP's hooks and checkpoint's recompute in place (the two ranks'
    collectives under checkpointing: test_fsdp_on_two_ranks_and_a_sigterm_to_one_of_them)."""
    args = [*RESNET, "trainer.save_weights=true", "trainer.strategy=fsdp"]
    none = api.run(args, out_dir=in_tmp / "none")
    ckpt = api.run([*args, "method=checkpoint"], out_dir=in_tmp / "ckpt")
    assert ckpt["plan_granularity"] == "block" and ckpt["plan_groups"]
    assert ckpt["mem_peak_act_bytes"] < none["mem_peak_act_bytes"]
    assert ckpt["train_loss"] == pytest.approx(none["train_loss"], rel=1e-5)
    _assert_same_updates(in_tmp / "ckpt", in_tmp / "none", _initial_weights(RESNET))
    # and FSDP's units (a block's output a view: torch warns of in-place ops on it) change
    # no gradient of one process's
    alone = api.run([*RESNET, "trainer.save_weights=true"], out_dir=in_tmp / "alone")
    assert none["train_loss"] == pytest.approx(alone["train_loss"], rel=1e-5)
    _assert_same_updates(in_tmp / "none", in_tmp / "alone", _initial_weights(RESNET))


# every method under ddp and fsdp: saved for backward exactly what one process saves on the
# rank's batch (their plans and packing see one rank's batch; FSDP's gathered parameters are no
# activation), or, where that is not what it does, refused in one line with the reason
SHARDED_AS_ONE = ("none", "pool", "prune", "quantize")
SHARDED_REFUSED = {"synthetic": "synthetic trains its partitions one phase at a time",
                   "offload": "nothing to offload to (use trainer.device=cuda)"}


@pytest.mark.slow
@pytest.mark.compat
def test_every_method_runs_sharded_or_refuses_in_one_line(in_tmp):
    """Under fsdp (DDP only wraps the model: a method sees the same module and batch as
    under FSDP, whose units and hooks are what could change what a method saves)."""
    import re

    from conftest import conf_options

    strategy = "fsdp"
    methods = conf_options("method")
    assert set(SHARDED_AS_ONE) | set(SHARDED_REFUSED) | {"checkpoint", "checkpoint+quantize"} \
        == set(methods)
    # prune's blocks of 32 rows need a rank's batch of 32 (mlp6's Linear inputs)
    size = ["trainer.batch_size=64", "model.widths=[64,64,64,64,64]", "model=mlp6",
            "dataset.image_size=8", "trainer=smoke"]
    none = _rank_step(size, strategy)
    for method in methods:
        args = [*size, f"method={method}"]
        if method in SHARDED_REFUSED:
            with pytest.raises(ConfigError, match=re.escape(SHARDED_REFUSED[method])) as e:
                api.run([*args, f"trainer.strategy={strategy}"], out_dir=in_tmp / method)
            assert "\n" not in str(e.value)
            continue
        row = _rank_step(args, strategy)
        if method in SHARDED_AS_ONE:
            alone = _rank_step(args, "single")
            assert row["mem_act_saved_bytes"] == alone["mem_act_saved_bytes"], method
            assert row["mem_peak_act_bytes"] == pytest.approx(alone["mem_peak_act_bytes"],
                                                              rel=0.02), method
        else:  # checkpoint's own plan under fsdp (whole groups, gathered parameters counted)
            assert row["mem_peak_act_bytes"] <= none["mem_peak_act_bytes"], method


def _estimate(args: list[str], strategy: str, ranks: int | None, out: Path) -> dict:
    """One rank's GPU-free estimate of a run of `ranks` ranks, in this process."""
    extra = ["trainer.estimate=true", "trainer.max_steps=0", f"trainer.strategy={strategy}",
             *([f"trainer.world_size={ranks}"] if ranks else [])]
    return api.run([*args, *extra], out_dir=out)


@pytest.mark.slow
@pytest.mark.compat
def test_estimate_of_n_ranks_and_the_figure_against_ranks(in_tmp):
    """`trainer.estimate=true trainer.world_size=N trainer.strategy=...` in one process: one
    rank's peak, without the ranks, as a rank measures it (on the fake group, a real step's
    tensors: within 2%); FSDP's falls with N, DDP's holds the whole model state and its buckets.
    The report draws them against the number of ranks, one line per method and strategy."""
    from memtrain.report.build import make_report

    sweep = in_tmp / "sweep"
    points = [("single", None, "none"), ("fsdp", 1, "none"), ("fsdp", 2, "none"),
              ("fsdp", 4, "none"), ("ddp", 2, "none"), ("fsdp", 2, "quantize"),
              ("fsdp", 4, "quantize")]
    rows = {(s, n, m): _estimate([*TINY, f"method={m}"], s, n, sweep / str(i))
            for i, (s, n, m) in enumerate(points)}
    for (s, n, m), row in rows.items():
        assert row["status"] == "ok" and "mem_estimate_error" not in row, (s, n, m, row)
        if n:
            assert row["world_size"] == n and row["local_batch_size"] == 8 // n
    for strategy in ("ddp", "fsdp"):
        measured = _rank_step(TINY, strategy, 2, steps=4)
        est = rows[(strategy, 2, "none")]
        assert est["mem_estimate_bytes"] == pytest.approx(measured["mem_tracker_peak_bytes"],
                                                          rel=0.02), strategy
        assert est["mem_estimate_act_bytes"] == pytest.approx(measured["mem_peak_act_bytes"],
                                                              rel=0.02), strategy
    fsdp = [rows[("fsdp", n, "none")]["mem_estimate_bytes"] for n in (1, 2, 4)]
    assert fsdp[0] > fsdp[1] > fsdp[2]
    assert rows[("ddp", 2, "none")]["mem_estimate_bytes"] > fsdp[1]
    make_report([sweep], in_tmp / "report", formats=("png",))
    drawn = pd.read_csv(in_tmp / "report" / "figures" / "sharding.csv")
    lines = {label: sorted(g["ranks"]) for label, g in drawn.groupby("label")}
    assert lines == {"none strategy=fsdp": [1, 2, 4], "none strategy=ddp": [2],
                     "none strategy=single": [1], "quantize strategy=fsdp": [2, 4]}, lines


@pytest.mark.parametrize("overrides,tasks", [
    ([], 1), (["trainer.strategy=fsdp"], 4), (["trainer.strategy=ddp", "trainer.world_size=2"], 2),
])
def test_slurm_runs_one_task_per_gpu(monkeypatch, overrides, tasks):
    """hydra/launcher=slurm: a sharded run's job has one task per rank (trainer.world_size, or
    one per GPU of the node), a run of one process one task."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memtrain.config import loader

    monkeypatch.setenv("MEMTRAIN_SLURM_GPUS_PER_NODE", "4")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(loader.conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", *overrides],
                      return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert cfg.hydra.launcher.tasks_per_node == tasks
    assert cfg.hydra.launcher.gpus_per_node == 4


def test_a_slurm_task_of_several_is_a_rank(monkeypatch):
    """In a SLURM task of a job of two (submitit's environment): torch's env:// variables for
    its rank, every GPU of the node left visible (the rank takes its local one), and for the
    second task Hydra kept out of the job's folder."""
    from hydra_plugins.memtrain_launcher import as_rank

    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "2",
                 "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu3",
                 "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):  # what the export sets: removed again after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    out = as_rank(["method=none"])
    assert out[0] == "method=none" and "hydra.output_subdir=null" in out
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == \
        ("1", "2", "1")
    # one node: the loopback (a node's name need not resolve); several: the first node's name
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[3-4]")
    as_rank(["method=none"])
    assert os.environ["MASTER_ADDR"] == "gpu3"
    assert distributed.launched() == (1, 2, 1)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert as_rank(["method=none"]) == ["method=none"]  # rank 0 writes what a job writes


@pytest.mark.slow
def test_bad_launches_are_one_line(in_tmp, monkeypatch):
    """What cannot run refuses before anything is built, in one line naming the fix."""
    with pytest.raises(ConfigError, match="trainer.strategy=ddp or fsdp|strategy=single"):
        api.run([*TINY, "trainer.world_size=2"], out_dir=in_tmp / "a")
    with pytest.raises(ConfigError, match="launch it with torchrun --nproc-per-node 2"):
        api.run([*TINY, "trainer.strategy=ddp", "trainer.world_size=2"], out_dir=in_tmp / "b")
    with pytest.raises(ConfigError, match="must be one of single, ddp, fsdp"):
        api.run([*TINY, "trainer.strategy=zero3"], out_dir=in_tmp / "c")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="strategy=single in one of 2 ranks"):
        api.run(TINY, out_dir=in_tmp / "d")
    # under torchrun too, a bad value is named as such before any launch check
    for bad, out in (("trainer.strategy=dpp", "e"), ("trainer.batch_size=-4", "f")):
        with pytest.raises(ConfigError, match="must be one of single, ddp, fsdp, got 'dpp'|"
                                              "trainer.batch_size must be in"):
            api.run([*TINY, bad], out_dir=in_tmp / out)


def test_the_rank_that_failed_first_is_the_rows():
    """`root_failure` on rank 0, over the store as the ranks left it (a store in this process,
    the heartbeats real threads): a rank's own failure before what rank 0 met after it; a rank
    that recorded nothing and whose heartbeat stopped (kill -9) before rank 0's closed
    connection; rank 0's own failure when every other rank is alive."""
    import torch.distributed as dist

    from memtrain.run.distributed import Heartbeat, World, lost_peer, record_failure, root_failure

    reset = RuntimeError("[pair.cc:534] Read error [127.0.0.1]:51376: Connection reset by peer")
    assert lost_peer(reset) and not lost_peer(RuntimeError("injected failure"))

    def world(alive: tuple[int, ...], *records) -> tuple[World, list]:
        store = dist.HashStore()
        beats = [Heartbeat(store, r) for r in alive]
        for rec in records:
            record_failure(store, *rec)
        return World("ddp", 0, 3, backend="gloo", failed_store=store), beats

    cases = [  # (ranks alive, records in order) -> the rank the row names
        ((2,), [(1, "error", "RuntimeError: injected", 2), (0, "error", str(reset), None, True)],
         1),
        ((2,), [(0, "error", str(reset), None, True)], 1),  # rank 1 gone without a word
        ((1, 2), [(0, "error", "RuntimeError: rank 0's own", 5)], 0),
        ((1, 2), [(0, "error", str(reset), None, True)], 0),  # nobody gone: the first record
    ]
    for alive, records, expected in cases:
        w, beats = world(alive, *records)
        try:
            root = root_failure(w, gone_s=1.0)
        finally:
            for b in beats:
                b.close()
        assert root["rank"] == expected, (alive, records, root)
        assert root.get("gone", False) == (expected == 1 and len(records) == 1), root


def test_multirun_under_torchrun_is_refused(cli_checks, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = cli_checks("-m", "model=mlp6", "trainer.strategy=ddp")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "under torchrun" in out.stderr and "hydra/launcher=slurm" in out.stderr
    out = cli_checks("-m", "model=mlp6", "trainer.stratgy=ddp")  # the input's checks first
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "did you mean trainer.strategy?" in out.stderr


def _initial_weights(args: list[str]) -> dict[str, torch.Tensor]:
    _, model, _ = api.build(args)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _row(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _assert_same_updates(a: Path, b: Path, start: dict[str, torch.Tensor]) -> None:
    """Every weight's change over the run (learning rate x the gradients' sum, through the
    optimizer) equal within summation order (rtol 1e-5)."""
    wa = torch.load(a / "weights.pt", weights_only=True)
    wb = torch.load(b / "weights.pt", weights_only=True)
    assert wa.keys() == wb.keys() == start.keys()
    for k in wa:
        torch.testing.assert_close(wa[k] - start[k], wb[k] - start[k], rtol=1e-5, atol=1e-7,
                                   msg=k)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.xdist_group("ranks")
def test_ddp_on_two_ranks_equals_one_process(in_tmp, ranks_alone):
    """`torchrun --nproc-per-node 2 -m memtrain ... trainer.strategy=ddp`: one ok row, written
    by rank 0 alone, the global batch split in two; its loss and every weight's update (the
    gradients, averaged over the ranks) those of one process on the same global batch. Then
    rank 1 killed mid-run: the row names it and keeps the metrics logged."""
    args = [*TINY, "trainer.save_weights=true"]
    failed = in_tmp / "failed"
    with ranks_alone():  # both torchruns; the checks in this process after them
        p = torchrun(*args, "trainer.strategy=ddp", f"hydra.run.dir={in_tmp / 'ddp'}",
                     cwd=in_tmp)
        assert p.returncode == 0, p.stderr[-3000:]
        assert sorted(p.name for p in in_tmp.iterdir()) == ["ddp"]  # no folder of rank 1's
        # a rank that vanishes is the row's failure: rank 1 is killed (SIGKILL: no handler,
        # no record) at step 45 while rank 0 waits for its gradients; rank 0's connection to
        # it is reset, rank 1's heartbeat has stopped, and rank 0 writes the row naming rank
        # 1, with every metric logged before (every 10th step: 0-40)
        killed = torchrun(*args, "trainer.strategy=ddp", "trainer.fault=kill",
                          "trainer.fault_rank=1", "trainer.fault_step=45",
                          "trainer.max_steps=50", "trainer.log_every=10",
                          f"hydra.run.dir={failed}", cwd=in_tmp, timeout=300)
    row = _row(in_tmp / "ddp")
    assert row["status"] == "ok" and row["world_size"] == 2 and row["local_batch_size"] == 4
    assert row["trainer.strategy"] == "ddp" and row["mem_peak_rank"] in (0, 1)
    one = api.run(args, out_dir=in_tmp / "one")
    assert row["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert row["test_acc"] == one["test_acc"]
    _assert_same_updates(in_tmp / "ddp", in_tmp / "one", _initial_weights(args))
    # each rank holds the whole model state, and DDP's buckets beside it
    assert row["rank_max.mem_params_bytes"] == row["rank_mean.mem_params_bytes"] == \
        one["mem_params_bytes"]
    assert row["mem_comm_buffers_bytes"] == one["mem_params_bytes"]
    # one rank's estimate, without the ranks, against the ranks measured
    est = _estimate(TINY, "ddp", 2, in_tmp / "estimate")
    assert est["mem_estimate_bytes"] == pytest.approx(row["rank_max.mem_tracker_peak_bytes"],
                                                      rel=0.05)
    assert killed.returncode != 0
    bad = _row(failed)
    assert bad["status"] == "error" and bad["failed_rank"] == 1, bad
    assert bad["error"].startswith(f"rank 1: {distributed.GONE}; rank 0 then met: "), bad["error"]
    assert "run ended with status=error: rank 1: its process ended" in killed.stderr
    logged = pd.read_csv(failed / "metrics.csv").query("split == 'train' and name == 'loss'")
    assert logged["step"].tolist() == [0, 10, 20, 30, 40]


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.xdist_group("ranks")
def test_fsdp_on_two_ranks_and_a_sigterm_to_one_of_them(in_tmp, ranks_alone):
    """`... trainer.strategy=fsdp`: one ok row; each rank holds half the parameters, gradients
    and optimizer state; loss and updates those of one process. Bad input that every rank
    refuses: rank 0's one line and exit status 2. Then SIGTERM to rank 1 of the
    same run under checkpointing (groups of two segments: the pass-through calls of FSDP units
    and their recompute): every rank stops at the same step and saves its shards together
    (torch.distributed.checkpoint), the row says interrupted, and the continue command it
    prints ends at the uninterrupted run's loss and weights."""
    args = [*TINY, "trainer.save_weights=true", "trainer.strategy=fsdp"]
    run, refused, stopped = in_tmp / "fsdp", in_tmp / "refused", in_tmp / "stopped"
    fault = [*args, "method=checkpoint", "method.strategy=uniform", "method.every=2",
             "trainer.fault=sigterm", "trainer.fault_rank=1", "trainer.fault_step=1"]
    with ranks_alone():  # the four torchruns; the checks in this process after them
        p = torchrun(*args, f"hydra.run.dir={run}", cwd=in_tmp)
        assert p.returncode == 0, p.stderr[-3000:]
        # bad input (every rank refuses it, before any folder is made)
        bad = torchrun(*args, "method=synthetic", f"hydra.run.dir={refused}", cwd=in_tmp)
        cut = torchrun(*fault, f"hydra.run.dir={stopped}", cwd=in_tmp)
        assert cut.returncode != 0
        cut_row = _row(stopped)  # before the continue command writes the finished row
        line = next(ln for ln in cut.stderr.splitlines() if "continue with: " in ln)
        command = shlex.split(line.split("continue with: ", 1)[1])
        assert command[:4] == ["torchrun", "--nproc-per-node=2", "-m", "memtrain"]
        shards = sorted(f.name for f in (stopped / "resume.dcp.2").iterdir())
        again = torchrun(*command[4:], cwd=in_tmp)
    row = _row(run)
    assert row["status"] == "ok" and row["world_size"] == 2
    single = [a for a in args if a != "trainer.strategy=fsdp"]
    one = api.run(single, out_dir=in_tmp / "one")
    for col in ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes"):
        for agg in ("rank_max", "rank_mean"):
            assert row[f"{agg}.{col}"] == pytest.approx(one[col] / 2, rel=0.05), (agg, col)
    assert row["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    _assert_same_updates(run, in_tmp / "one", _initial_weights(single))
    # one rank's estimate, without the ranks: the model state and activations as each rank
    # measured them; the peak replays collectives that end where they are issued, while gloo's
    # run asynchronously: a rank may hold one more unit's gathered parameters and one more
    # reduce-scatter buffer meanwhile (two runs here measured 280 and 326 kB against 278 kB)
    est = _estimate(TINY, "fsdp", 2, in_tmp / "estimate")
    for e, col in (("mem_estimate_act_bytes", "mem_peak_act_bytes"),
                   ("mem_estimate_act_temp_bytes", "mem_tracker_act_temp_bytes"),  # no scratch
                   ("mem_estimate_at_act_peak_optim_bytes", "mem_optim_bytes")):
        assert est[e] == pytest.approx(row[f"rank_max.{col}"], rel=0.05), col
    _, model, _ = api.build(single)
    unit = max(sum(p.numel() * p.element_size() for m in block for p in m.parameters())
               for block in distributed.blocks_of(model))
    for agg in ("rank_max", "rank_mean"):
        measured = row[f"{agg}.mem_tracker_peak_bytes"]
        assert 0.98 * est["mem_estimate_bytes"] <= measured <= est["mem_estimate_bytes"] + \
            2 * unit, (agg, measured, est["mem_estimate_bytes"], unit)
    # what the collectives hold is no activation memory: each rank's activations and backward
    # temporaries, tensor by tensor, are one process's on the rank's batch (the allocator's
    # column adds the scratch no tensor holds, gloo's collective buffers among it)
    assert row["rank_max.mem_tracker_act_temp_bytes"] == pytest.approx(
        _rank_step(single, "single")["mem_tracker_act_temp_bytes"], rel=0.05)

    # bad input under torchrun (every rank refuses it, before any folder is made): rank 0 says
    # why in one line and exits 2, as one process does; nothing is written
    said = [ln for ln in bad.stderr.splitlines() if ln.startswith("memtrain: ")]
    assert said == [f"memtrain: error: method=synthetic with trainer.strategy=fsdp: "
                    f"{SHARDED_REFUSED['synthetic']}, each a model of its own, which the "
                    f"strategy's wrapper of one model does not cover; use "
                    f"trainer.strategy=single"], bad.stderr[-3000:]
    assert "exitcode  : 2" in bad.stderr  # torchrun's report of the ranks' exit status
    assert not refused.exists()

    assert cut_row["status"] == "interrupted" and cut_row["signal"] == "SIGTERM", \
        cut_row.get("error")
    assert cut_row["failed_step"] == 2 and cut_row["plan_groups"] == "0-1;2-3;4-4"
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt"]
    assert again.returncode == 0, again.stderr[-3000:]
    done = _row(stopped)
    assert done["status"] == "ok" and done["resumed_at_step"] == 2
    assert not list(stopped.glob("resume*"))  # a finished run keeps no checkpoint
    # recomputation changes no gradient, and the resumed run continues as if never stopped
    assert done["train_loss"] == pytest.approx(row["train_loss"], rel=1e-5)
    _assert_same_updates(stopped, run, _initial_weights(single))
