"""memtrain-willfit (memtrain/willfit.py): the table's peaks are the estimate's, its largest batch
is verified by full estimates and agrees with find_max_batch, a real step at that batch fits
and one above it does not, the answer names what fits first, and bad input is one line, exit 2,
nothing written. mlp6 on 16 px images: every estimate takes a second or two."""

import json

import pytest

from memtrain import api, willfit
from memtrain.run.capacity import GiB

TINY = ["model=mlp6", "dataset.image_size=16", "dataset.train_size=4096", "dataset.test_size=8",
        "trainer=smoke", "trainer.seed=0"]
NO_CONTEXT = ["trainer.cuda_context_gb=0"]  # the assumed 0.27 GiB would fill these tiny caps


def _estimate(in_tmp, batch: int, method: str = "none") -> dict:
    """The estimate as `memtrain trainer.estimate=true` records it: an independent path (the
    runner's probes) to the same numbers."""
    return api.run([*TINY, f"method={method}", f"trainer.batch_size={batch}",
                    "trainer.estimate=true", "trainer.max_steps=0"],
                   out_dir=in_tmp / f"est_{method}_{batch}")


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """none and checkpoint at batch 16 on a card whose budget is none's estimate at batch 48
    (headroom 0.1, no context): the largest batch with none is 48."""
    folder = tmp_path_factory.mktemp("willfit")
    need = api.run([*TINY, "method=none", "trainer.batch_size=48", "trainer.estimate=true",
                    "trainer.max_steps=0"], out_dir=folder / "need")["mem_estimate_bytes"]
    gb = (need + 64) / 0.9 / GiB  # the budget 0.9 x cap just above the peak at 48
    out = api.will_fit([*TINY, "trainer.batch_size=16", f"trainer.gpu_memory_gb={gb!r}",
                        *NO_CONTEXT], methods=["checkpoint"], defaults_only=True,
                       out_dir=folder / "out")
    return out, folder / "out"


@pytest.mark.slow
def test_peaks_are_the_estimate_of_the_same_config(found, in_tmp):
    out, _ = found
    rows = {r["setting"]: r for r in out.rows}
    for setting, method in (("none", "none"), ("checkpoint", "checkpoint")):
        row, est = rows[setting], _estimate(in_tmp, 16, method)
        assert row["status"] == "ok" and row["peak_bytes"] == est["mem_estimate_bytes"]
        assert row["act_bytes"] == est["mem_estimate_act_bytes"]
        # the breakdown at the peak adds up to it
        assert sum(v for k, v in row.items() if k.startswith("at_peak_")) == row["peak_bytes"]
    assert rows["none"]["grads_exact"] is True and rows["checkpoint"]["grads_exact"] is True
    assert rows["none"]["overhead"] == 0.0
    assert rows["checkpoint"]["overhead_source"].startswith("the planner's cost model")


@pytest.mark.slow
def test_largest_batch_is_verified_and_is_find_max_batchs(found, in_tmp):
    out, _ = found
    budget = out.card["budget_bytes"]
    for r in out.rows:
        assert r["max_batch_verified"], r
        assert r["peak_at_max_batch_bytes"] <= budget < r["peak_at_max_batch_plus1_bytes"]
    none = next(r for r in out.rows if r["setting"] == "none")
    assert none["max_batch"] == 48
    # full estimates by the runner's path at B and B + 1, and find_max_batch's own search
    assert _estimate(in_tmp, 48)["mem_estimate_bytes"] <= budget
    assert _estimate(in_tmp, 49)["mem_estimate_bytes"] > budget
    gb = out.card["gpu_memory_gb"]
    row = api.run([*TINY, "method=none", "trainer.batch_size=16", "trainer.max_steps=0",
                   "trainer.find_max_batch=true", f"trainer.gpu_memory_gb={gb!r}", *NO_CONTEXT],
                  out_dir=in_tmp / "fmb")
    assert row["max_batch_size"] == 48


@pytest.mark.slow
def test_a_real_step_at_the_largest_batch_fits_and_one_above_does_not(found, in_tmp):
    """Checked against measurement: the accounting step of a real CPU run at the batch the
    command reports, for none and checkpoint: its tracked peak (what the estimate predicts)
    within the budget, one batch above not; its allocator peak (kernel scratch too) within
    10% of the estimate, the tolerance of the estimate's own tests. Step 3 is measured: by
    then SGD's momentum is allocated for every parameter, as in the estimate's step."""
    out, _ = found
    budget = out.card["budget_bytes"]
    for r in out.rows:
        b = r["max_batch"]
        real = {n: api.run([*TINY, *r["overrides"].split(), f"trainer.batch_size={n}",
                            "trainer.max_steps=3"], out_dir=in_tmp / f"{r['method']}_{n}")
                for n in (b, b + 1)}
        assert real[b]["status"] == real[b + 1]["status"] == "ok"
        assert real[b]["mem_tracker_peak_bytes"] <= budget < real[b + 1]["mem_tracker_peak_bytes"]
        assert abs(r["peak_at_max_batch_bytes"] / real[b]["mem_peak_alloc_bytes"] - 1) < 0.10


@pytest.mark.slow
def test_the_files_hold_the_rows_and_the_answer(found):
    out, folder = found
    assert sorted(p.name for p in folder.iterdir()) == ["runs", "willfit.csv", "willfit.json",
                                                         "willfit.png"]
    # each setting as a probes-only run's row: memtrain-report reads them as a sweep's
    from memtrain.report.tables import load_runs

    runs, skipped = load_runs([folder / "runs"])
    assert skipped == [] and len(runs) == len(out.rows)
    by_method = dict(zip(runs["method"], runs["mem_estimate_bytes"]))
    assert by_method == {r["method"]: r["peak_bytes"] for r in out.rows}
    saved = json.loads((folder / "willfit.json").read_text())
    assert saved["answer"] == out.answer and len(saved["rows"]) == len(out.rows)
    peak = out.rows[0]["peak_bytes"] / GiB
    assert out.answer == f"fits with none at batch 16 (peak {peak:.2f} GiB); the largest batch " \
                         f"with none: 48"
    assert "allocator's rounding" in willfit.table(out)


@pytest.mark.slow
def test_when_none_does_not_fit_the_answer_names_the_cheapest_that_does(in_tmp):
    """Batch 2048 on a cap between quantize's peak and none's: quantize fits, none does not."""
    peak = {m: _estimate(in_tmp, 2048, m)["mem_estimate_bytes"] for m in ("none", "quantize")}
    assert peak["quantize"] < peak["none"]
    gb = (peak["quantize"] + peak["none"]) / 2 / 0.9 / GiB
    out = api.will_fit([*TINY, "trainer.batch_size=2048", f"trainer.gpu_memory_gb={gb!r}",
                        *NO_CONTEXT], methods=["quantize"], defaults_only=True, figure=False)
    rows = {r["setting"]: r for r in out.rows}
    assert not rows["none"]["fits"] and rows["quantize"]["fits"]
    assert rows["quantize"]["grads_exact"] is False
    assert rows["quantize"]["accuracy_evidence"] == "docs/methods/quantize.md"
    # the sweep that measures its accuracy is one memtrain accepts (on a dataset of the user's)
    import shlex

    from memtrain.config import loader

    command = shlex.split(rows["quantize"]["accuracy_command"])
    assert command[:3] == ["memtrain", "-m", "hydra/sweeper=variants"]
    assert 'hydra.sweeper.variants=["method=none","method=quantize"]' in command
    assert "trainer.batch_size=2048" in command and "dataset=YOUR_DATASET" in command
    assert not any(a.startswith("trainer.gpu_memory_gb") for a in command)
    loader.check_overrides([a.replace("YOUR_DATASET", "synthetic") for a in command[2:]],
                           multirun=True)
    assert out.answer.startswith("cheapest that fits: quantize (") and \
        out.answer.endswith("(approximate gradients)")


@pytest.mark.slow
def test_a_batch_the_method_refuses_does_not_fit_and_is_said(in_tmp):
    """prune refuses mlp6 at a batch of one (its blocks would take no less than the inputs
    they replace) and runs at 64: on a card too small for any batch, the search meets that
    refusal, counts it as not fitting and says why, and the command goes on to its answer
    (it ended in the refusal before)."""
    out = api.will_fit([*TINY, "trainer.batch_size=64", "trainer.gpu_memory_gb=0.01",
                        *NO_CONTEXT], methods=["prune"], defaults_only=True, figure=False,
                       out_dir=in_tmp / "out")
    rows = {r["setting"]: r for r in out.rows}
    assert rows["prune"]["status"] == "ok" and not rows["prune"]["fits"]
    assert rows["prune"]["max_batch"] == rows["none"]["max_batch"] == 0
    assert "batch 1 refused: method=prune prunes nothing in MLP" in \
        rows["prune"]["max_batch_how"]
    assert out.answer.startswith("no method or stack fits batch 64")


def test_largest_batch_on_a_peak_affine_in_pieces():
    """A peak that moves from the update (flat in the batch) to backward (steeper) as the
    batch grows: the first line, from two small batches, overshoots; secant steps land on the
    right piece, and the answer is verified at B and B + 1 in a handful of estimates."""
    calls = []

    def peak(b: int) -> int:
        calls.append(b)
        return max(10_000 + 10 * b, 2_000 + 37 * b)

    budget = 1_000_000
    want = max(b for b in range(1, 100_000) if peak(b) <= budget)
    calls.clear()
    out = willfit.largest_batch(peak, budget, 16)
    assert out["max_batch"] == want and out["max_batch_verified"]
    assert out["peak_at_max_batch_bytes"] <= budget < out["peak_at_max_batch_plus1_bytes"]
    assert len(set(calls)) <= 8, calls
    # the estimate's breakdown at 16 gives both lines: the guess is right, verified at B and
    # B + 1 alone; a breakdown that saw only the flat piece still ends at the answer
    parts = {"params": 10_000 - 16 * 10, "act": 16 * 10}  # the update's moment at batch 16
    act = {"params": 2_000 - 16 * 37, "act": 16 * 30, "other": 16 * 7}  # the activations' peak
    est = {**{f"mem_estimate_at_peak_{k}_bytes": v for k, v in parts.items()},
           **{f"mem_estimate_at_act_peak_{k}_bytes": v for k, v in act.items()}}
    lines = willfit.breakdown_lines(est, 16)
    assert lines == [(10_000 - 16 * 10, 10.0), (2_000 - 16 * 37, 37.0)]
    calls.clear()
    out = willfit.largest_batch(peak, budget, 16, lines=[(10_000, 10), (2_000, 37)])
    assert (out["max_batch"], out["max_batch_how"], sorted(set(calls))) == \
        (want, "breakdown", [want, want + 1])
    calls.clear()
    out = willfit.largest_batch(peak, budget, 16, lines=[(10_000, 10)])
    assert out["max_batch"] == want and out["max_batch_verified"]
    assert len(set(calls)) <= 8, calls
    # nothing fits, and a peak flat in the batch
    assert willfit.largest_batch(peak, 100, 16)["max_batch"] == 0
    flat = willfit.largest_batch(lambda b: 50, 100, 16, limit=1024)
    assert flat["max_batch"] == 1024 and flat["max_batch_verified"]


def _row(setting, fits, exact, overhead, peak=1, max_batch=1, method=None):
    return {"setting": setting, "method": method or setting.split()[0], "status": "ok",
            "fits": fits, "grads_exact": exact, "overhead": overhead, "peak_bytes": peak,
            "max_batch": max_batch}


def test_the_answer_ranks_exact_and_approximate_by_overhead():
    rows = [_row("none", False, True, 0.0, max_batch=8),
            _row("checkpoint", True, True, 0.3, max_batch=20),
            _row("checkpoint budget_fraction=0.1", True, True, 0.2, max_batch=30),
            _row("pool", True, False, 0.1, max_batch=24), _row("quantize", True, False, None)]
    assert willfit.answer(rows, 16) == (
        "cheapest with exact gradients that fits: checkpoint budget_fraction=0.1 (+20% step "
        "time, largest batch 30); cheapest that fits: pool (+10% step time, largest batch 24) "
        "(approximate gradients)")
    rows = [r | {"fits": False} for r in rows]
    assert willfit.answer(rows, 16) == ("no method or stack fits batch 16 on this card; the "
                                        "largest batch of any: 30 with checkpoint "
                                        "budget_fraction=0.1")


def test_when_no_single_process_fits_the_answer_names_fsdp():
    rows = [_row("none", False, True, 0.0, max_batch=8), _row("quantize", False, False, 2.0),
            _row("none fsdp x4", True, True, None, peak=2 * GiB, max_batch=64, method="none")
            | {"ranks": 4}]
    assert willfit.answer(rows, 16) == (
        "no single method or stack fits batch 16 on this card; the largest batch of any: 8 with "
        "none; fsdp over 4 ranks would: none fsdp x4 (peak 2.00 GiB per rank)")
    # none sharded does not fit: exact gradients before a smaller peak of approximate ones
    rows = [rows[0], rows[1], rows[2] | {"fits": False},
            _row("quantize fsdp x4", True, False, None, peak=1 * GiB, method="quantize")
            | {"ranks": 4},
            _row("checkpoint fsdp x4", True, True, None, peak=3 * GiB, method="checkpoint")
            | {"ranks": 4}]
    assert willfit.answer(rows, 16).endswith(
        "fsdp over 4 ranks would: checkpoint fsdp x4 (peak 3.00 GiB per rank)")


def test_ranks_shard_each_chosen_method_at_its_defaults():
    chosen = willfit.settings(["quantize", "synthetic"], "all", ranks=4)
    assert [s.label for s in chosen if s.ranks == 4] == \
        ["none fsdp x4", "quantize fsdp x4", "synthetic fsdp x4"]
    assert all(not s.params for s in chosen if s.ranks == 4)
    assert not any(s.ranks > 1 for s in willfit.settings(None, "defaults"))


@pytest.mark.slow
def test_an_fsdp_row_is_the_estimate_of_one_rank(in_tmp):
    out = api.will_fit([*TINY, "trainer.batch_size=64", "trainer.gpu_memory_gb=1",
                        *NO_CONTEXT, "ranks=4"], methods=["none"], defaults_only=True,
                       figure=False)
    row = next(r for r in out.rows if r["setting"] == "none fsdp x4")
    est = api.run([*TINY, "method=none", "trainer.batch_size=64", "trainer.estimate=true",
                   "trainer.max_steps=0", "trainer.strategy=fsdp", "trainer.world_size=4"],
                  out_dir=in_tmp / "e")
    assert row["peak_bytes"] == est["mem_estimate_bytes"]
    assert row["max_batch"] == 4 * row["max_batch_per_rank"] and row["max_batch_verified"]


def test_overhead_and_error_come_from_the_rows_of_the_same_setting():
    """CUDA rows before CPU rows, the same model before others, the setting's own options
    matched (quantize at 4 bits is not quantize at 2); the estimate's error only from a row of
    the very setting (model, batch, input size, precision)."""
    from omegaconf import OmegaConf

    def run(model, bits, rel, device="cpu", **more):
        return {"method": "quantize", "status": "ok", "model": model, "method.bits": bits,
                "step_time_rel": rel, "device": device, **more}

    rows = [("a.csv", run("mlp6", 4, 3.0)), ("a.csv", run("mlp6", 4, 2.0)),
            ("b.csv", run("mlp6", 2, 9.0)), ("c.csv", run("resnet18", 4, 1.5))]
    q4, q2 = willfit.Setting("quantize"), willfit.Setting("quantize", ("method.bits=2",))
    defaults = {"method.bits": 4}
    assert willfit.overhead_from_rows(q4, "mlp6", rows, defaults) == \
        (1.5, "measured CPU rows (2 rows: a.csv)")
    assert willfit.overhead_from_rows(q2, "mlp6", rows, defaults)[0] == 8.0
    assert willfit.overhead_from_rows(q4, "vit_tiny", rows, defaults) == \
        (1.0, "measured CPU rows (other models: mlp6, resnet18; 3 rows: a.csv, c.csv)")
    rows.append(("g.csv", run("resnet18", 4, 1.25, device="cuda")))
    assert willfit.overhead_from_rows(q4, "mlp6", rows, defaults)[1].startswith(
        "committed CUDA rows (other models: resnet18")
    cfg = OmegaConf.create({"trainer": {"precision": "fp32"}, "dataset": {"image_size": 16}})
    measured = run("mlp6", 4, 3.0, **{"trainer.batch_size": 8, "trainer.precision": "fp32",
                                     "dataset.image_size": 16, "mem_estimate_bytes": 99,
                                     "mem_tracker_peak_bytes": 100})
    assert willfit.estimate_error(q4, cfg, "mlp6", 8, [("m.csv", measured)], defaults) == \
        (99 / 100 - 1, "m.csv")
    assert willfit.estimate_error(q4, cfg, "mlp6", 16, [("m.csv", measured)], defaults) is None


@pytest.mark.parametrize("args, says", [
    (["card=gtx0"], "card must be one of rtx3090, rtx4090"),
    (["card=rtx4090", "trainer.gpu_memory_gb=24"], "card= and trainer.gpu_memory_gb both"),
    (["trainer.gpu_memory_gb=nan"], "trainer.gpu_memory_gb"),
    ([], "needs the card's memory"),
    (["card=l4", "methods=none,bogus"], "methods must be a comma-separated list of none"),
    (["card=l4", "method=pool"], "tries every method itself"),
    (["card=l4", "trainer.batch_size=0"], "trainer.batch_size"),
    (["card=l4", "modle=mlp6"], "modle"),
    (["card=l4", "settings=some"], "settings must be all or defaults"),
    (["card=l4", "ranks=1"], "ranks must be a whole number >= 2"),
    (["card=l4", "ranks=3", "trainer.batch_size=16"], "not a multiple of ranks=3"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_nothing_written(in_tmp, capsys, args, says):
    with pytest.raises(SystemExit) as e:
        willfit.main([*TINY, *args, f"out={in_tmp / 'out'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memtrain-willfit: error: ") and says in err[0]
    assert list(in_tmp.iterdir()) == []
