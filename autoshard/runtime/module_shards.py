"""The parallel module's parameters and buffers as this rank's shards: installed under the original
FQNs as plain local tensors (their layouts in ``specs``), state dicts (DTensor views of the shards,
or gathered whole), full gradients, and gradient clipping by the global norm over all shards.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..capture import CapturedGraph
from ..plans import PlanError
from ..specs import ShardSpec
from .collectives import MeshComm, gather_whole, shard_input
from .replicas import agree_on_tensors

log = logging.getLogger(__name__)

__all__ = ["ShardedState"]


class ShardedState(nn.Module):
    """What :class:`~autoshard.runtime.parallel.ParallelModule` does with its parameter and buffer
    shards (it sets ``plan``, ``device_mesh``, ``device``, ``comm`` and its modes' programs; the
    shards' layouts are in ``specs``)."""

    def _install_state(self, model: nn.Module, graph: CapturedGraph, checkpoint: str | None, replicas: str) -> None:
        """Register this rank's shard of every parameter and buffer under all of its original FQNs,
        in the original module order (so state-dict keys come in the original order). Parameters
        are plain local tensors (optimizers and autograd see no DTensor dispatch); their layouts are
        kept in ``self.specs`` and DTensor views are built for checkpoints and state dicts. The
        ranks' copies are checked equal (or broadcast from rank 0) first, as ``replicas`` says."""
        from .state import load_local_shards

        placeholders = self._modes[self.plan.training].program.placeholders
        specs = {p.fqn: p.spec for p in placeholders if p.kind in ("param", "buffer")}
        canonical = {name: fqn for fqn, names in graph.tied_params.items() for name in names}
        sources = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        sources, self.replicas = agree_on_tensors(sources, "check" if checkpoint is not None else replicas)
        log.info("autoshard.parallelize: %s", self.replicas)
        local = load_local_shards(sources, specs, self.comm, self.device, checkpoint)
        made: dict[str, torch.Tensor] = {}
        self.specs: dict[str, ShardSpec] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            owner = _owner(self, f"{prefix}.x" if prefix else "x")[0]
            for attr, original in [*module._parameters.items(), *module._buffers.items()]:
                if original is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                fqn = canonical.get(name, name)
                if fqn not in specs:
                    raise PlanError(f"'{name}' of the model is not in the captured graph's inputs; the plan cannot "
                                    f"place it (was the model changed after planning?)")
                if fqn not in made:
                    made[fqn] = nn.Parameter(local[fqn], requires_grad=original.requires_grad) \
                        if isinstance(original, nn.Parameter) else local[fqn]
                self.specs[name] = specs[fqn] or ShardSpec.replicate(original.ndim)
                if isinstance(original, nn.Parameter):
                    owner.register_parameter(attr, made[fqn])        # type: ignore[arg-type]
                else:
                    owner.register_buffer(attr, made[fqn], persistent=attr not in module._non_persistent_buffers_set)

    def _tensor_of(self, fqn_or_placeholder: str) -> torch.Tensor:
        # The owning submodule of each name is found once (the module tree is fixed once installed):
        # walking it for every parameter at every call cost ~1 ms of CPU per GPT-2 forward.
        owners = self.__dict__.setdefault("_owners", {})
        found = owners.get(fqn_or_placeholder)
        if found is None:
            found = owners[fqn_or_placeholder] = _owner(self, fqn_or_placeholder, create=False)
        owner, attr = found
        return getattr(owner, attr)

    # -- buffers each rank updates from its own shard ------------------------------------------

    def _mark_buffers_stale(self, local_state: Mapping[str, tuple[int, ...]]) -> None:
        """After a training forward whose kernels updated these buffers (FQN -> mesh axes) from this
        rank's shard alone: their copies differ across those axes until :meth:`sync_buffers`."""
        stale = self.__dict__.setdefault("_stale_buffers", {})
        for fqn, axes in local_state.items():
            stale[fqn] = tuple(sorted({*stale.get(fqn, ()), *axes}))

    def sync_buffers(self) -> None:
        """Average the buffers that each rank updates from its own share of the batch (the running
        statistics of batch norm planned ``batch_norm="per_rank"``) over the ranks whose copies
        differ, one all-reduce per set of mesh axes and dtype: every copy then holds the update the
        whole batch makes. Runs by itself before an eval-mode forward and a state dict; call it
        before reading such a buffer directly. A no-op when nothing is pending. Collective: every
        rank must call it."""
        stale: dict[str, tuple[int, ...]] = self.__dict__.pop("_stale_buffers", {})
        groups: dict[tuple, list[torch.Tensor]] = {}
        for fqn, axes in sorted(stale.items()):
            t = self._tensor_of(fqn)
            groups.setdefault((axes, t.dtype), []).append(t)
        for (axes, _), tensors in groups.items():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.comm.raw_all_reduce(flat, axes, phase="buffers")
            flat /= math.prod(self.comm.mesh_shape[a] for a in axes)
            with torch.no_grad():
                for t, mean in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(mean.view_as(t))

    # -- state dicts -----------------------------------------------------------------------------

    def _dtensor(self, name: str, t: torch.Tensor) -> DTensor:
        """A DTensor view of a local shard (same storage: loading into it loads into the module)."""
        return DTensor.from_local(t.detach(), self.device_mesh, self.specs[name].to_placements(2), run_check=False)

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """Original FQNs -> DTensor views of this rank's shards (what ``torch.distributed.checkpoint``
        saves and loads; loading into them loads into the module; collective)."""
        self.sync_buffers()
        return {k: self._dtensor(k, v) for k, v in super().state_dict(keep_vars=True).items()}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full, gathered state dict with the original FQNs (collective: every rank must call it)."""
        # gathered by the runtime's own collectives, one per sharded dim (DTensor's full_tensor gathers
        # a dim sharded over both axes in two steps and logs a warning about it on every rank)
        self.sync_buffers()
        return {k: gather_whole(v.detach(), self.comm, self.specs[k].dims)
                for k, v in super().state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load a full (global tensors) or sharded (DTensor) state dict; each rank keeps its shards."""
        own = super().state_dict(keep_vars=True)
        self.sync_buffers()        # a buffer left out of state_dict must not stay pending on its own
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for k, target in own.items():
                if k not in state_dict:
                    continue
                src = state_dict[k]
                if isinstance(src, DTensor):
                    src = src.full_tensor()
                target.copy_(shard_input(src.to(self.device), self.comm, self.specs[k].dims))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Parameter FQN -> the full (gathered) gradient, or None (collective)."""
        return {k: None if p.grad is None else gather_whole(p.grad, self.comm, self.specs[k].dims)
                for k, p in self.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all shards, like ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model; returns that norm (collective). Call this, not torch's function,
        which would only see this rank's shards."""
        local = []
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            replicas = 1
            for a, n in enumerate(self.comm.mesh_shape):
                if a not in self.specs[name].used_axes():
                    replicas *= n
            local.append((p.grad, replicas))
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = torch.stack([g.detach().abs().max() for g, _ in local]).max() if local \
                else torch.zeros((), device=self.device)
            total = self.comm.raw_all_reduce(total.reshape(1).float(), _all_axes(self.comm), op="max",
                                             phase="optimizer")[0]
        else:
            powered = sum((torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type / r for g, r in local),
                          torch.zeros((), device=self.device))
            total = self.comm.raw_all_reduce(powered.reshape(1), _all_axes(self.comm), phase="optimizer")[0]
            total = total ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g, _ in local:
            g.detach().mul_(coef.to(g.dtype))
        return total


def _owner(root: nn.Module, fqn: str, create: bool = True) -> tuple[nn.Module, str]:
    *path, attr = fqn.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            if not create:
                raise KeyError(f"no module '{part}' on the path to '{fqn}'")
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, attr


def _all_axes(comm: MeshComm) -> tuple[int, ...]:
    return comm.live_axes(range(len(comm.mesh_shape))) or (0,)
