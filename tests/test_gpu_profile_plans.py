"""Under the shipped GPU profile (measured H100 compute), small models that fit one device at the
default budget get plans that shard their work, not replicated ones: with 8 GPUs the step's compute
splits 8 ways and the bucketed gradient all-reduce mostly hides behind backward."""
import io
import contextlib

import pytest

import autoshard
from autoshard.models import build_model
from autoshard.plans.explain import sharding_counts

SMALL = {
    "gpt2-mini": ("gpt2-mini", {}),
    "gpt2-256": ("gpt2", dict(num_layers=4, n_embd=256, n_head=4, batch=8, seq=128)),
    "bert-256": ("bert-base", dict(num_layers=4, hidden_size=256, num_attention_heads=4,
                                   intermediate_size=1024, batch=8, seq=128)),
    "llama-256": ("llama-7b", dict(num_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                   num_key_value_heads=4, batch=8, seq=128)),
}


@pytest.mark.parametrize("key", list(SMALL))
def test_a_small_model_at_a_generous_budget_is_sharded_under_h100_nvlink(key):
    name, overrides = SMALL[key]
    model, args, kwargs = build_model(name, **overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        plan = autoshard.plan(model, args, kwargs, mesh=(2, 4), hardware="h100-nvlink")
        replicated = autoshard.plan(model, args, kwargs, mesh=(1, 1), hardware="h100-nvlink")
    counts = sharding_counts(plan)
    assert counts.split_ops >= 0.75 * counts.ops, (key, counts, plan.time)
    # and it is modeled faster than one device running the whole batch
    assert plan.time["total"] < replicated.time["total"], (plan.time, replicated.time)
