"""The README's "Training with a plan" snippets, run as written on 4 gloo ranks (the README's
commands and other snippets: tests/test_readme_commands.py). Their undefined names are bound by
small models: ``model``/``example_batch``/``data`` by a seeded gpt2-tiny and its batch of 8,
``net``/``example_x``/``data`` by the mlp preset with class labels; the second snippet runs after
the first, in its namespace (it uses the first one's ``mesh``), as a reader would. A new snippet
classified to run here needs its bindings in BINDINGS."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import readme_commands as rc
from autoshard.models import build_model
from autoshard.runtime.parallel import ParallelModule
from runtime_harness import on_all_ranks


def _hf() -> dict:
    torch.manual_seed(0)
    model, _, batch = build_model("gpt2-tiny", device="cpu", batch=8)
    return {"model": model, "example_batch": batch, "data": [batch, batch]}


def _plain() -> dict:
    torch.manual_seed(0)
    net, (x,), _ = build_model("mlp", device="cpu", batch=8)
    y = torch.randint(0, net.net[-1].out_features, (8,), generator=torch.Generator().manual_seed(1))
    return {"net": net, "example_x": x, "data": [(x, y), (x, y)]}


BINDINGS = {
    "mesh = autoshard.init_mesh((2, 2))": _hf,
    "plan = autoshard.plan_once(net, (example_x,), mesh=(2, 2))": _plain,
}


def test_training_snippets_run_as_written_on_four_ranks() -> None:
    keys = [k for k, how in rc.SNIPPETS.items() if how == rc.RUN_DISTRIBUTED]
    assert list(BINDINGS) == keys, f"bind the undefined names of every distributed README snippet: {keys}"
    namespace: dict = {"__name__": "readme"}
    losses = []
    for key in keys:
        namespace.update(BINDINGS[key]())
        namespace.pop("loss", None)
        before = dict(namespace)
        on_all_ranks(f"README snippet {key!r}", exec, compile(rc.snippet(key).code, f"README {key!r}", "exec"),
                     namespace)
        losses.append(float(namespace["loss"].detach()))
        # the snippet's optimizer steps the parallel module it built (not one left by an earlier snippet)
        built = [v for k, v in namespace.items() if isinstance(v, ParallelModule) and k not in before]
        assert len(built) == 1, f"{key!r}: expected one new parallel module, got {len(built)}"
        stepped = {id(p) for group in namespace["opt"].param_groups for p in group["params"]}
        assert stepped == {id(p) for p in built[0].parameters()}, f"{key!r}: opt does not step the new module"
    assert all(math.isfinite(v) for v in losses), losses
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    assert all(v == losses for v in every), f"the ranks' losses differ: {every}"
