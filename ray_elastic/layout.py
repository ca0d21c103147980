"""How a program's training state is laid out over one slice's devices.

The default, `Layout()`, is what ray_elastic always did: a 1-D `data` mesh
over every device of the slice, the batch split over it, and the state
replicated on every device. A sharded layout names an in-slice mesh
(`fsdp`, `tensor`, ... as MaxText does) and how each parameter is split
over it, either as a PartitionSpec pytree or as Flax logical axis names
plus logical axis rules (`flax.linen.logical_to_mesh`). The optimizer
state follows its parameters (`optax.tree_map_params`); the batch is
split over the data-like axes. Inside a slice XLA runs the collectives;
across slices each host exchanges only the shards it holds, with the
hosts of the same index in the other slices (dispatch/step_runner.py).

Only plain data lives here: the specs are resolved against the state's
shapes inside the workers (`resolve_param_specs`), so the driver never
imports JAX for them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Union

from ray_elastic.errors import ConfigError

__all__ = ["Layout", "LayoutPlan", "MAXTEXT_MESH_AXES"]

# Axes the global batch is split over when they are in the mesh: the
# data-like ones (each device of them sees different rows).
DATA_AXES = ("data", "fsdp")
# MaxText's mesh axes, major to minor (its `mesh_axes` setting), and the
# data-like ones among them (its `activation_batch` rule).
MAXTEXT_MESH_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive",
                     "tensor", "tensor_transpose", "tensor_sequence", "expert", "autoregressive")
MAXTEXT_BATCH_AXES = ("data", "fsdp", "fsdp_transpose", "expert")


def _rule_target(target: Any) -> Any:
    """A rule's target as Flax takes it: a mesh axis, a tuple of them, or
    None; MaxText's lists become tuples and its empty list None."""
    if isinstance(target, (list, tuple)):
        return tuple(target) or None
    return target


@dataclasses.dataclass(frozen=True)
class Layout:
    """The in-slice layout of the training state.

    mesh: (axis name, size) pairs, major to minor, over the devices of one
        slice (hosts x devices per host, in process order). One size may be
        -1: the devices left over. Empty: one `data` axis over every
        device, the state replicated (the default).
    params: how each parameter is split: a pytree of
        `jax.sharding.PartitionSpec` shaped like the params, or a callable
        taking the params' abstract tree (`jax.ShapeDtypeStruct` leaves)
        and returning one. With `rules`, the names in it are Flax logical
        axis names (e.g. from `nn.get_partition_spec` of a model built with
        `nn.with_logical_partitioning`). None: replicated.
    rules: Flax logical axis rules, (logical name, mesh axis or None)
        pairs, as `flax.linen.logical_to_mesh` takes them.
    batch_axes: the mesh axes the batch rows are split over (those present
        in the mesh); the others see the same rows.
    """

    mesh: tuple = ()
    params: Union[Any, Callable[[Any], Any], None] = None
    rules: tuple = ()
    batch_axes: tuple = DATA_AXES

    def __post_init__(self):
        mesh = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in self.mesh)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "rules", tuple(
            (r[0], _rule_target(r[1])) if isinstance(r, (list, tuple)) and len(r) == 2 else r for r in self.rules))
        object.__setattr__(self, "batch_axes", tuple(self.batch_axes))
        names = []
        for axis in mesh:
            if not (isinstance(axis, tuple) and len(axis) == 2 and isinstance(axis[0], str)
                    and isinstance(axis[1], int) and not isinstance(axis[1], bool)
                    and (axis[1] >= 1 or axis[1] == -1)):
                raise ConfigError("layout.mesh", f"each axis is a (name, size >= 1 or -1) pair, got {axis!r}")
            names.append(axis[0])
        if len(set(names)) != len(names):
            raise ConfigError("layout.mesh", f"axis names must be unique, got {names}")
        if sum(size == -1 for _, size in mesh) > 1:
            raise ConfigError("layout.mesh", f"at most one axis may have size -1, got {mesh}")
        for rule in self.rules:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
                raise ConfigError("layout.rules", f"each rule is a (logical name, mesh axis or None) pair, got {rule!r}")
            targets = rule[1] if isinstance(rule[1], tuple) else (rule[1],)
            for t in targets:
                if t is not None and t not in names:
                    raise ConfigError("layout.rules", f"rule {rule!r} maps to {t!r}, which is not a mesh axis {names}")
        if self.rules and self.params is None:
            raise ConfigError("layout.params", "rules are given but no logical axis names for the params")
        if self.params is not None and not mesh:
            raise ConfigError("layout.mesh", "params are partitioned but no mesh is given; name its axes, "
                              "e.g. Layout.from_maxtext(ici_fsdp_parallelism=-1, ...)")
        for a in self.batch_axes:
            if not isinstance(a, str):
                raise ConfigError("layout.batch_axes", f"must be mesh axis names, got {self.batch_axes!r}")
        if mesh and not any(a in names for a in self.batch_axes):
            raise ConfigError("layout.batch_axes", f"none of {self.batch_axes} is a mesh axis {names}: "
                              "the batch must be split over at least one")

    @classmethod
    def from_maxtext(
        cls,
        ici_data_parallelism: int = 1,
        ici_fsdp_parallelism: int = -1,
        ici_tensor_parallelism: int = 1,
        params: Any = None,
        rules: Any = (),
        *,
        mesh_axes: Optional[Any] = None,
        **ici_parallelism: int,
    ) -> "Layout":
        """MaxText's in-slice parallelism flags (`ici_<axis>_parallelism`,
        -1 for the devices left over) and its `logical_axis_rules` as it
        writes them (list targets, `[]` for unsharded, a name listed again
        as a fallback). The mesh is `data` x `fsdp` x `tensor` when only
        those are used; with a flag or a rule for any other of MaxText's
        axes, or `mesh_axes` given, it is MaxText's full set of axes in its
        order (`MAXTEXT_MESH_AXES`), the unused ones of size 1."""
        sizes = {"data": ici_data_parallelism, "fsdp": ici_fsdp_parallelism, "tensor": ici_tensor_parallelism}
        for flag, size in ici_parallelism.items():
            axis = flag[len("ici_"):-len("_parallelism")] if flag.startswith("ici_") and flag.endswith(
                "_parallelism") else None
            if axis is None or axis not in MAXTEXT_MESH_AXES:
                raise ConfigError("layout.mesh", f"unknown MaxText flag {flag}; the flags are ici_<axis>_parallelism "
                                  f"for the axes {MAXTEXT_MESH_AXES}")
            sizes[axis] = size
        named = {t for _, target in (tuple(r) for r in rules)
                 for t in (target if isinstance(target, (list, tuple)) else (target,)) if t is not None}
        if mesh_axes is None and (set(sizes) | named) <= {"data", "fsdp", "tensor"}:
            mesh_axes = ("data", "fsdp", "tensor")
        axes = tuple(MAXTEXT_MESH_AXES if mesh_axes is None else mesh_axes)
        unknown = sorted(set(sizes) - set(axes))
        if unknown:
            raise ConfigError("layout.mesh", f"parallelism is set for {unknown}, which are not in mesh_axes {axes}")
        batch = tuple(a for a in MAXTEXT_BATCH_AXES if a in axes)
        return cls(mesh=tuple((a, sizes.get(a, 1)) for a in axes), params=params, rules=rules, batch_axes=batch)

    @property
    def sharded(self) -> bool:
        """Whether hosts of a slice may hold different parts of the state."""
        return self.params is not None

    def plan(self, devices_per_slice: int) -> "LayoutPlan":
        """The mesh's axis sizes on a slice of that many devices."""
        if not self.mesh:
            return LayoutPlan(("data",), (devices_per_slice,), ("data",))
        known = math.prod(size for _, size in self.mesh if size != -1)
        sizes = []
        for name, size in self.mesh:
            if size == -1:
                if devices_per_slice % known:
                    raise ConfigError("layout.mesh", f"{self._fixed()} does not divide the slice's "
                                      f"{devices_per_slice} devices (hosts x devices per host)")
                size = devices_per_slice // known
            sizes.append(size)
        if math.prod(sizes) != devices_per_slice:
            raise ConfigError(
                "layout.mesh",
                f"the mesh {dict(zip(self.axis_names, sizes))} has {math.prod(sizes)} devices but a slice has "
                f"{devices_per_slice} (hosts x devices per host); set one axis to -1 or change the slice",
            )
        batch = tuple(a for a in self.batch_axes if a in self.axis_names)
        return LayoutPlan(self.axis_names, tuple(sizes), batch)

    @property
    def axis_names(self) -> tuple:
        return tuple(name for name, _ in self.mesh)

    def _fixed(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.mesh if s != -1) or "the fixed axes"


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """A layout resolved for one slice's device count."""

    axis_names: tuple
    axis_sizes: tuple
    batch_axes: tuple

    @property
    def batch_ways(self) -> int:
        return math.prod(size for name, size in zip(self.axis_names, self.axis_sizes) if name in self.batch_axes)


def resolve_param_specs(layout: Layout, abstract_params: Any) -> Optional[Any]:
    """The params' PartitionSpec pytree in mesh axes (None: replicated).
    Runs in a worker: imports JAX and, for logical names, Flax."""
    if layout.params is None:
        return None
    specs = layout.params(abstract_params) if callable(layout.params) else layout.params
    if layout.rules:
        import flax.linen as nn

        specs = nn.logical_to_mesh(specs, layout.rules)
    return specs
