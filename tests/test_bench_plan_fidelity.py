"""The plan fidelity bench's model names: the default set, any width of a family and other input
sizes (held-out runs); its statistics and head-to-head ratios."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plan_fidelity  # noqa: E402


def test_default_models_and_any_width_of_a_family():
    assert plan_fidelity.model_spec("gpt2-128") == plan_fidelity.MODELS["gpt2-128"]
    preset, overrides = plan_fidelity.model_spec("llama-192")
    assert preset == "llama-tiny" and overrides["hidden_size"] == 192 and overrides["intermediate_size"] == 768
    assert plan_fidelity.model_spec("gpt2-256")[1]["n_embd"] == 256
    assert plan_fidelity.model_spec("cnn-32") == ("cnn", {"channels": 32})
    assert plan_fidelity.model_spec("mlp-512") == ("mlp", {"features": 512, "hidden": 2048, "out_features": 10,
                                                           "depth": 4})


@pytest.mark.parametrize("key", ["gpt3-128", "gpt2-", "gpt2-x", "llama-0", "bert"])
def test_unknown_model_names_are_refused_with_the_choices(key):
    with pytest.raises(ValueError, match=r"unknown model .*<family>-<width> with family one of gpt2, llama, bert, cnn"):
        plan_fidelity.model_spec(key)


def test_a_key_may_set_the_batch_and_the_sequence_or_image_side():
    assert plan_fidelity.model_sizes("gpt2-128") == (8, 128)
    assert plan_fidelity.model_sizes("cnn-32") == (8, 64) and plan_fidelity.model_sizes("mlp-256") == (8, None)
    assert plan_fidelity.model_sizes("gpt2-160:16x64") == (16, 64)
    assert plan_fidelity.model_spec("gpt2-160:16x64")[1]["n_positions"] == 64
    assert plan_fidelity.model_spec("llama-96:4x256")[1]["max_position_embeddings"] == 256
    assert plan_fidelity.model_sizes("bert-64:32") == (32, 128)
    assert plan_fidelity.model_sizes("cnn-32:16x48") == (16, 48)
    assert plan_fidelity.model_spec("cnn-32:16x48") == ("cnn", {"channels": 32})
    assert plan_fidelity.model_sizes("mlp-256:32") == (32, None)


@pytest.mark.parametrize("key, message", [("mlp-256:32x8", "mlp takes a batch only"),
                                          ("gpt2-128:6x64", "batch 6 does not split over the 4 ranks"),
                                          ("gpt2-128:8x", "BATCH or BATCHxSEQ"), ("gpt2-128:0", "BATCH or BATCHxSEQ"),
                                          ("gpt3-128:8x64", "unknown model")])
def test_bad_sizes_are_refused_with_the_form_they_take(key, message):
    with pytest.raises(ValueError, match=message):
        plan_fidelity.model_spec(key)


def test_a_sized_model_builds_its_inputs_at_those_sizes():
    _, kwargs = plan_fidelity.build("gpt2-32:4x16")
    assert tuple(kwargs["input_ids"].shape) == (4, 16)
    _, kwargs = plan_fidelity.build("cnn-4:4x32")
    assert tuple(kwargs["x"].shape)[::2] == (4, 32) and tuple(kwargs["labels"].shape) == (4,)
    _, kwargs = plan_fidelity.build("mlp-16:12")
    assert tuple(kwargs["x"].shape) == (12, 16)


def _measured(ms: float, loss: float = 1.0) -> dict:
    return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "all_ms": [ms] * 3, "first_loss": loss}


def _model(head_to_head: dict | None) -> dict:
    plans = [{"name": "data_parallel", "modeled_s": 0.100, "measured": _measured(104.0)},
             {"name": "megatron", "modeled_s": 0.150, "measured": _measured(160.0)},
             {"name": "zero3", "modeled_s": 0.130, "measured": _measured(140.0)},
             {"name": "solved", "modeled_s": 0.101, "measured": _measured(110.0)}]
    return {"plans": plans, "references": {"torch DDP": {"name": "torch DDP", **_measured(100.0)}},
            "head_to_head": head_to_head}


def test_solved_over_fastest_is_the_head_to_head_ratio_where_it_ran():
    """The rounds' ratio (1.10x over DDP) is kept beside; the target is checked on the fresh
    head-to-head medians, and a solved plan faster there is 1.00x."""
    h2h = {"solved": "solved", "rival": "torch DDP", "rounds": 8,
           "solved_measured": _measured(103.0), "rival_measured": _measured(101.0)}
    s = plan_fidelity.analyse(_model(h2h))
    assert s["solved_over_fastest_screen"] == pytest.approx(1.10)
    assert s["solved_over_fastest"] == pytest.approx(103 / 101)
    assert s["head_to_head"]["rival"] == "torch DDP" and s["pass"]["solved_over_fastest"]
    h2h["solved_measured"] = _measured(99.0)
    assert plan_fidelity.analyse(_model(h2h))["solved_over_fastest"] == 1.0
    h2h["solved_measured"] = _measured(107.0)
    assert not plan_fidelity.analyse(_model(h2h))["pass"]["solved_over_fastest"]


def test_the_head_to_head_ratio_carries_a_seeded_bootstrap_interval():
    """The interval holds the ratio of the medians, narrows with more rounds of the same spread, and
    is the same on every analysis of one run."""
    solved = [100.0 + (i % 7) for i in range(24)]
    rival = [98.0 + (i % 5) for i in range(24)]
    low, high = plan_fidelity.ratio_interval(solved, rival)
    assert low <= 103 / 100 <= high and high - low > 0
    assert plan_fidelity.ratio_interval(solved, rival) == (low, high)
    wide = high - low
    low, high = plan_fidelity.ratio_interval(solved * 4, rival * 4)
    assert high - low < wide
    assert plan_fidelity.ratio_interval([100.0], rival) is None
    h2h = {"solved": "solved", "rival": "torch DDP", "rounds": 24, "solved_measured": {"median_ms": 103.0, "all_ms": solved},
           "rival_measured": {"median_ms": 100.0, "all_ms": rival}}
    cell = plan_fidelity._head_to_head_cell(plan_fidelity.analyse(_model(h2h))["head_to_head"])
    assert cell.startswith("103.0 / 100.0 (torch DDP, 24 rounds, ratio 1.03x, 90% CI ")


def test_without_a_head_to_head_the_rounds_ratio_is_the_ratio():
    s = plan_fidelity.analyse(_model(None))
    assert s["solved_over_fastest"] == s["solved_over_fastest_screen"] == pytest.approx(1.10)
    assert "head_to_head" not in s


def test_same_function_is_the_step0_loss_within_1e_5_relative():
    assert plan_fidelity.same_function(2.0, 2.0 + 1e-5)
    assert not plan_fidelity.same_function(2.0, 2.0 + 1e-4)
    assert not plan_fidelity.same_function(2.0, None) and not plan_fidelity.same_function(None, 2.0)
    assert not plan_fidelity.same_function(2.0, float("nan"))


def test_a_rival_computing_another_function_keeps_the_target_and_adds_a_same_function_ratio():
    """DDP with per-rank batch-norm statistics (another step-0 loss) stays the rival the target is
    checked against; the ratio to the fastest configuration computing the solved plan's function is
    its own head to head's where that ran, the rounds' ratio otherwise."""
    h2h = {"solved": "solved", "rival": "torch DDP", "rounds": 8,
           "solved_measured": _measured(110.0), "rival_measured": _measured(90.0)}
    model = _model(h2h)
    model["references"]["torch DDP"]["first_loss"] = 1.5
    s = plan_fidelity.analyse(model)
    assert s["solved_over_fastest"] == pytest.approx(110 / 90) and not s["pass"]["solved_over_fastest"]
    assert s["fastest_same_function"] == "data_parallel"
    assert s["solved_over_fastest_same_function"] == s["solved_over_fastest_same_function_screen"] == pytest.approx(110 / 104)
    assert "head_to_head_same_function" not in s
    model["head_to_head_same_function"] = {"solved": "solved", "rival": "data_parallel", "rounds": 8,
                                           "solved_measured": _measured(105.0), "rival_measured": _measured(103.0)}
    s = plan_fidelity.analyse(model)
    assert s["solved_over_fastest_same_function"] == pytest.approx(105 / 103)
    assert s["head_to_head_same_function"]["rival"] == "data_parallel"
    assert s["solved_over_fastest_same_function_screen"] == pytest.approx(110 / 104)
    assert "105.0 / 103.0 ms, data_parallel" in plan_fidelity._same_function_cell("cnnsync-8", s)


def test_a_same_function_rival_head_to_head_gives_both_ratios():
    h2h = {"solved": "solved", "rival": "torch DDP", "rounds": 8,
           "solved_measured": _measured(103.0), "rival_measured": _measured(101.0)}
    s = plan_fidelity.analyse(_model(h2h))
    assert s["solved_over_fastest_same_function"] == s["solved_over_fastest"] == pytest.approx(103 / 101)


def test_budgets_below_the_smallest_feasible_one_are_spread_above_it():
    """Fractions of the solved peak the floor allows are kept; each one it does not is replaced by a
    budget between the floor and the lowest kept one, so the model still runs as many plans."""
    assert plan_fidelity.budget_points(100.0, 30.0, (0.8, 0.6, 0.4)) == [
        ("budget 80% of solved peak", 80), ("budget 60% of solved peak", 60), ("budget 40% of solved peak", 40)]
    points = plan_fidelity.budget_points(100.0, 70.0, (0.8, 0.6, 0.4))
    assert points[0] == ("budget 80% of solved peak", 80)
    assert [b for _, b in points[1:]] == [77, 74]
    assert len({name for name, _ in points}) == 3
    spread = plan_fidelity.budget_points(100.0, 82.0, (0.8, 0.6, 0.4))
    assert [b for _, b in spread] == [96, 91, 87] and all("above the smallest feasible" in n for n, _ in spread)


def _drift(ratios: dict[str, float]) -> list[dict]:
    return [{"family": f, "work": 1.0, "now_ms": r, "profile_ms": 1.0, "ratio": r} for f, r in ratios.items()]


def test_machine_drift_is_reported_beside_each_model():
    """Median over families of time now / the profile's, before and after the timing; per family
    in the detail table (a family timed only once shows '-' where it was not)."""
    model = _model(None)
    model["model"] = "gpt2-128"
    model["drift"] = {"before": _drift({"matmul": 1.5, "pointwise": 1.0, "norm": 1.1}),
                      "after": _drift({"matmul": 0.9, "pointwise": 1.0})}
    s = plan_fidelity.analyse(model)
    assert s["drift_before"] == pytest.approx(1.1) and s["drift_after"] == pytest.approx(0.95)
    assert plan_fidelity._drift_cell(model["drift"]) == "1.10x / 0.95x"
    assert plan_fidelity._drift_cell(None) == "-"
    table = plan_fidelity.drift_detail([model]).splitlines()
    assert table[-3] == "| model | matmul | norm | pointwise |"
    assert table[-1] == "| gpt2-128 | 1.50 / 0.90 | 1.10 / - | 1.00 / 1.00 |"
    assert plan_fidelity.drift_detail([_model(None) | {"model": "x"}]) == ""


def test_errors_under_the_profile_scaled_to_the_drift_are_reported_beside():
    """Spearman and errors again over the plans priced under the drift-scaled profile; where some
    could not be re-priced there, over those that were, beside the unscaled profile's over the same."""
    model = _model(None)
    for p, now in zip(model["plans"], (0.104, 0.150, 0.170, 0.110)):
        p["modeled_drift_s"] = now
    s = plan_fidelity.analyse(model)
    assert s["spearman"] == pytest.approx(1.0) and s["spearman_drift"] == pytest.approx(0.8)
    assert s["median_err_drift"] == pytest.approx(10 / 160 / 2) and s["worst_err_drift"] == pytest.approx(30 / 140)
    assert plan_fidelity._drift_fidelity_cell(s) == "0.80 / 3% / 21%"
    del model["plans"][2]["modeled_drift_s"]
    s = plan_fidelity.analyse(model)
    assert s["spearman"] == pytest.approx(1.0) and s["median_err"] == pytest.approx((10 / 160 + 10 / 140) / 2)
    assert plan_fidelity._drift_fidelity_cell(s) == (
        "1.00 / 0% / 6% (over the 3 of 4 plans re-priced; unscaled over them: 1.00 / 6%)")
    assert plan_fidelity._drift_fidelity_cell(plan_fidelity.analyse(_model(None))) == "-"


def test_plans_are_repriced_under_the_profile_scaled_to_the_drift():
    """The solved plan of a real model priced again under the bench's measured profile: the same time
    where the machine has not drifted, a longer one (less than twice: the links are not scaled) where
    every timed family takes twice as long; a plan run as another's is not priced again."""
    import autoshard

    key = "cnn-16"
    hw = autoshard.load_hardware(str(plan_fidelity.RESULTS / "fidelity-measured.yaml"))
    graph, _ = plan_fidelity.capture(key)
    plan = autoshard.plan(graph, mesh=plan_fidelity.MESH, hardware=hw, name=key, outputs=plan_fidelity.OUTPUTS,
                          **plan_fidelity.function_options(key))
    families = ("matmul", "attention", "pointwise", "norm", "conv", "conv_unaligned", "batch_norm")
    for ratio in (1.0, 2.0):
        model = {"model": key, "drift": {"before": _drift(dict.fromkeys(families, ratio))},
                 "plans": [{"name": "solved", "plan": plan.to_dict(), "measured": _measured(1.0)},
                           {"name": "again", "plan": plan.to_dict(), "measured": _measured(1.0), "same_as": "solved"}]}
        plan_fidelity.reprice_under_drift(model, graph, hw)
        solved, again = model["plans"]
        assert "modeled_drift_s" not in again
        if ratio == 1.0:
            assert solved["modeled_drift_s"] == pytest.approx(plan.time["total"], rel=1e-9)
        else:
            assert plan.time["total"] * 1.2 < solved["modeled_drift_s"] < 2 * plan.time["total"]
