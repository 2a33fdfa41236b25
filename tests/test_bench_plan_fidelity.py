"""The plan fidelity bench's model names: the default set, and any width of a family (held-out runs)."""
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


@pytest.mark.parametrize("key", ["gpt3-128", "gpt2-", "gpt2-x", "llama-0", "bert"])
def test_unknown_model_names_are_refused_with_the_choices(key):
    with pytest.raises(ValueError, match=r"unknown model .*<family>-<width> with family one of gpt2, llama, bert, cnn"):
        plan_fidelity.model_spec(key)


def _measured(ms: float, loss: float = 1.0) -> dict:
    return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "first_loss": loss}


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


def test_without_a_head_to_head_the_rounds_ratio_is_the_ratio():
    s = plan_fidelity.analyse(_model(None))
    assert s["solved_over_fastest"] == s["solved_over_fastest_screen"] == pytest.approx(1.10)
    assert "head_to_head" not in s
