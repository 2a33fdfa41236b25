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
