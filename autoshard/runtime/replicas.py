"""Replica consistency: what every rank must hold alike before a step means the same thing.

Each rank takes its shards from its own copy of the model, so a model built with per-rank seeds
would train silently wrong: :func:`agree_on_tensors` compares a cheap exact checksum of every
parameter and buffer across ranks and raises :class:`ReplicaMismatchError` naming what differs, or
(``replicas="broadcast"``) gives every rank rank 0's values. In global input mode every rank must
pass the same batch, and random ops (dropout) need the same RNG state on every rank (each draws the
whole mask and keeps its block): :func:`agree_on_step` checks both with one small all-gather.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

__all__ = ["REPLICA_MODES", "INPUT_CHECKS", "ReplicaMismatchError", "agree_on_step", "agree_on_tensors",
           "checksum", "random_nodes"]

REPLICA_MODES = ("check", "broadcast")
INPUT_CHECKS = ("first", "always", "never")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22


class ReplicaMismatchError(ValueError):
    """Ranks that must agree differ: parameter or buffer values, the global batch, or RNG states."""


def checksum(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], str]:
    """An exact checksum of ``t``'s bits (sum and position-weighted sum of its elements read as
    integers, computed where ``t`` lives), with its shape and dtype."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.view(_INT_OF_SIZE[x.element_size()])
    total = weighted = 0
    for start in range(0, x.numel(), _CHUNK):
        part = x[start:start + _CHUNK].to(torch.int64)
        w = torch.arange(start + 1, start + 1 + part.numel(), device=part.device, dtype=torch.int64) % 1_000_003
        total += int(part.sum())
        weighted += int((part * w).sum())
    return total, weighted, tuple(t.shape), str(t.dtype)


def _gather(mine: Any, wait: Callable[[Any], None] | None = None) -> list[Any]:
    """Every rank's ``mine``. ``wait``: how to wait for the collectives (:meth:`MeshComm.wait
    <autoshard.runtime.collectives.MeshComm.wait>`, which raises a diagnosis posted meanwhile instead of
    waiting for a rank that will not come); then the pickled objects travel as CPU tensors (gloo)."""
    world = dist.get_world_size()
    if wait is None:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        return everyone
    data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
    sizes = torch.empty(world, dtype=torch.int64)
    wait(dist.all_gather_into_tensor(sizes, torch.tensor([data.numel()], dtype=torch.int64), async_op=True))
    most = int(sizes.max())
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = torch.empty(world * most, dtype=torch.uint8)
    wait(dist.all_gather_into_tensor(out, padded, async_op=True))
    return [pickle.loads(out[r * most:r * most + int(n)].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]


def agree_on_tensors(tensors: Mapping[str, torch.Tensor], mode: str) -> tuple[dict[str, torch.Tensor], str]:
    """Check (``mode="check"``) or make (``"broadcast"``) every tensor equal on all ranks. Returns the
    tensors to shard (rank 0's copies after a broadcast) and one line saying what was done.
    Tensors on the meta device (a model whose weights come from a checkpoint) are skipped.
    Collective: every rank must call it."""
    if mode not in REPLICA_MODES:
        raise ValueError(f"replicas must be one of {', '.join(map(repr, REPLICA_MODES))}, got {mode!r}")
    unique: dict[int, str] = {}
    for name, t in tensors.items():
        if t.device.type != "meta":
            unique.setdefault(id(t), name)
    names = list(unique.values())
    if not names:
        return dict(tensors), "no parameter or buffer values to compare (meta tensors: read from the checkpoint)"
    if mode == "broadcast":
        out = dict(tensors)
        for name in names:
            copy = tensors[name].detach().clone()
            dist.broadcast(copy, src=0)
            out[name] = copy
        for name, t in tensors.items():          # tied names share the broadcast copy
            if name not in names and t.device.type != "meta":
                out[name] = out[unique[id(t)]]
        return out, f"{len(names)} parameters and buffers broadcast from rank 0"
    everyone = _gather([checksum(tensors[n]) for n in names])
    differ = {n: [r for r, theirs in enumerate(everyone) if theirs[i] != everyone[0][i]] for i, n in enumerate(names)}
    differ = {n: ranks for n, ranks in differ.items() if ranks}
    if differ:
        listed = "; ".join(f"'{n}' on rank(s) {ranks}" for n, ranks in list(differ.items())[:5])
        raise ReplicaMismatchError(
            f"{len(differ)} of {len(names)} parameters/buffers differ from rank 0 ({listed}): every rank must start "
            f"from the same model. Seed every rank alike (torch.manual_seed(0) before building the model), load the "
            f"same weights on every rank, or pass replicas='broadcast' to parallelize to copy rank 0's values")
    return dict(tensors), f"{len(names)} parameters and buffers checked identical on all ranks"


_RANDOM_OPS = ("aten.dropout.default", "aten.native_dropout.default", "aten.bernoulli", "aten.rand",
               "aten.randn", "aten.randint", "aten.randperm", "aten.normal", "aten.uniform", "aten.multinomial")


def random_nodes(nodes: Iterable[Any]) -> list[str]:
    """Names of the fx nodes that draw random numbers (dropout with p > 0 in training, random
    factories, attention with dropout)."""
    from ..capture import op_name

    out = []
    for node in nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name in ("aten.dropout.default", "aten.native_dropout.default"):
            p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
            if p and train is not False:
                out.append(node.name)
        elif name == "aten.scaled_dot_product_attention.default":
            if (node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)):
                out.append(node.name)
        elif name.startswith(_RANDOM_OPS):
            out.append(node.name)
    return out


def _rng_digest(device: torch.device) -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    return h.hexdigest()


def agree_on_step(inputs: list[tuple[str, Any]] | None, random: list[str], device: torch.device, *,
                  wait: Callable[[Any], None] | None = None) -> None:
    """:class:`ReplicaMismatchError` unless every rank passed the same inputs (``inputs``: (where,
    value) pairs; None in local input mode, where each rank passes its own shard) and, when the
    program draws random numbers (``random``: its random nodes), every rank has the same RNG state.
    ``wait``: see :func:`_gather`. Collective: every rank must call it with the same kind of arguments.
    (Whether every rank ran backward on the same steps is :class:`~autoshard.runtime.step_watch.StepWatch`'s
    business.)"""
    mine: dict[str, Any] = {}
    if inputs is not None:
        mine["inputs"] = [(where, checksum(v) if isinstance(v, torch.Tensor) else repr(v)) for where, v in inputs]
    if random:
        mine["rng"] = _rng_digest(device)
    everyone = _gather(mine, wait)
    if "inputs" in mine:
        bad = sorted({where for theirs in everyone
                      for (where, a), (_, b) in zip(theirs["inputs"], everyone[0]["inputs"]) if a != b})
        ranks = [r for r, theirs in enumerate(everyone) if theirs["inputs"] != everyone[0]["inputs"]]
        if ranks:
            raise ReplicaMismatchError(
                f"in global input mode every rank must pass the same batch, but input(s) {', '.join(bad) or '?'} "
                f"differ on rank(s) {ranks} from rank 0: give every rank the same data (same seed and order), or "
                f"parallelize with input_mode='local' and pass each rank its shard (pmodel.comm.shard_input); "
                f"check_inputs='never' skips this check")
    if "rng" in mine:
        ranks = [r for r, theirs in enumerate(everyone) if theirs["rng"] != everyone[0]["rng"]]
        if ranks:
            raise ReplicaMismatchError(
                f"the model draws random numbers ({', '.join(random[:3])}) and rank(s) {ranks} have another RNG state "
                f"than rank 0: each rank draws the whole dropout mask and keeps its block, so the states must be "
                f"equal. Call torch.manual_seed(seed) with the same seed on every rank (not seed + rank)")
