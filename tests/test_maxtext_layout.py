"""MaxText's sharding settings as they are written, and programs traced
under the slice's mesh with the layout's logical axis rules active.

The rules below are a copy of MaxText's default `logical_axis_rules`
(configs/base.yml), written into the test: list targets, `[]` for an
unsharded dimension, a logical name listed again as a fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ray_elastic import ConfigError, Layout
from ray_elastic.layout import MAXTEXT_MESH_AXES

MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose"]],
    ["activation_heads", ["tensor", "sequence"]],
    ["activation_length", "sequence"],
    ["activation_embed", "tensor"],
    ["activation_mlp", "tensor"],
    ["activation_kv", "tensor"],
    ["activation_vocab", ["tensor", "sequence"]],
    ["activation_vocab", "tensor"],
    ["activation_vocab", "sequence"],
    ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
    ["vocab", ["tensor", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence"]],
    ["embed", ["fsdp", "sequence"]],
    ["norm", "tensor"],
    ["heads", ["tensor", "autoregressive"]],
    ["kv", []],
    ["cache_batch", []],
    ["cache_heads", ["autoregressive", "tensor"]],
    ["cache_kv", []],
    ["cache_sequence", []],
]


def test_maxtext_rules_as_written_build_its_mesh():
    layout = Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2, rules=MAXTEXT_RULES,
                                 params=lambda abstract: abstract)
    assert layout.axis_names == MAXTEXT_MESH_AXES
    plan = layout.plan(8)
    sizes = dict(zip(plan.axis_names, plan.axis_sizes))
    assert sizes["fsdp"] == 4 and sizes["tensor"] == 2
    assert all(size == 1 for axis, size in sizes.items() if axis not in ("fsdp", "tensor"))
    assert plan.batch_axes == ("data", "fsdp", "fsdp_transpose", "expert") and plan.batch_ways == 4
    rules = dict(layout.rules[::-1])  # the first rule of a name wins in Flax; here: every target normalised
    assert rules["kv"] is None and rules["mlp"] == ("fsdp_transpose", "tensor", "autoregressive")
    assert layout.rules[0] == ("activation_batch", ("data", "fsdp", "fsdp_transpose"))


def test_maxtext_rules_resolve_param_specs_as_flax_does():
    import flax.linen as nn
    from jax.sharding import PartitionSpec as P

    layout = Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2, rules=MAXTEXT_RULES,
                                 params={"w": P("embed", "mlp"), "k": P("embed", "heads", "kv")})
    from ray_elastic.layout import resolve_param_specs

    specs = resolve_param_specs(layout, None)
    # embed -> fsdp (+ the size-1 axes), mlp -> its tensor-parallel axes; kv unsharded.
    assert specs == nn.logical_to_mesh({"w": P("embed", "mlp"), "k": P("embed", "heads", "kv")}, layout.rules)
    assert "fsdp" in specs["w"][0] and "tensor" in specs["w"][1] and specs["k"][2] is None


def test_clear_errors_for_maxtext_settings():
    with pytest.raises(ConfigError, match="layout.mesh.*ici_pipeline_parallelism"):
        Layout.from_maxtext(ici_pipeline_parallelism=2)
    with pytest.raises(ConfigError, match="layout.rules.*nowhere"):
        Layout.from_maxtext(rules=[["embed", ["fsdp", "nowhere"]]], params=lambda a: a)
    with pytest.raises(ConfigError, match="layout.mesh.*expert"):
        Layout.from_maxtext(mesh_axes=("data", "fsdp", "tensor"), ici_expert_parallelism=2)


def test_old_three_axis_mesh_stays_for_data_fsdp_tensor():
    layout = Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2,
                                 rules=[["embed", "fsdp"], ["mlp", "tensor"]], params=lambda a: a)
    assert layout.axis_names == ("data", "fsdp", "tensor")


TRACE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, optax
sys.path.insert(0, {root!r})
from tests.test_maxtext_layout import MAXTEXT_RULES
from ray_elastic import Layout, TrainProgram
from ray_elastic.worker.setup import compile_step, lay_out

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(h, ("activation_batch", "activation_mlp"))
        return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")))(h)

def init(rng):
    return nn.unbox(MLP().init(rng, jnp.zeros((1, 8)))["params"])

def loss(params, batch, ctx):
    # What a model's logical constraint resolves to while it is traced.
    seen.append({{"ctx_mesh": dict(ctx.mesh.shape), "traced_mesh": dict(jax.sharding.get_abstract_mesh().shape),
                  "activation": str(nn.logical_to_mesh_axes(("activation_batch", "activation_mlp")))}})
    return jnp.mean((MLP().apply({{"params": params}}, batch["x"]) - batch["x"]) ** 2)

def batch(seed, step, shard, n):
    return {{"x": np.random.default_rng((seed, step, shard)).standard_normal((8, 8)).astype(np.float32)}}

def specs(abstract):
    return nn.get_partition_spec(jax.eval_shape(lambda: MLP().init(jax.random.PRNGKey(0), jnp.zeros((1, 8)))))["params"]

seen = []
layout = Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2, rules=MAXTEXT_RULES, params=specs)
program = TrainProgram(init, loss, optax.sgd(0.1), batch, layout)
laid = lay_out(jax.devices(), lambda: program, 0, [])
compile_step(laid, 0, 2, [])
kernel = str(laid.param_shardings["Dense_0"]["kernel"].spec)
print(json.dumps({{"seen": seen[0], "kernel": kernel}}))
"""


def test_a_model_with_logical_activation_constraints_traces_under_the_slice_mesh():
    """A model that constrains its activations by logical names (as
    MaxText's layers do) is traced under the slice's mesh with the rules
    active: its constraint is in the compiled step, and the loss sees the
    mesh in its context. (A process of its own: 8 CPU devices.)"""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", TRACE.format(root=root)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    seen = result["seen"]
    assert seen["ctx_mesh"]["fsdp"] == 4 and seen["ctx_mesh"]["tensor"] == 2
    assert seen["traced_mesh"] == seen["ctx_mesh"]  # the mesh is set while the loss is traced
    # The rules are active: the activation's logical names resolve to mesh axes.
    assert seen["activation"].endswith("(('data', 'fsdp', 'fsdp_transpose'), 'tensor')"), seen
    assert "fsdp" in result["kernel"] and "tensor" in result["kernel"]


LM_TRACE = """
import json, sys
sys.path.insert(0, {root!r})
import jax
from jax.sharding import NamedSharding
import examples.lm as lm
from ray_elastic.worker.setup import compile_step, lay_out

seen = []
plain = lm._constrained

def inspected(x, names, on):
    y = plain(x, names, on)
    # Called while the step compiles, with the sharding the compiled step gives this activation.
    jax.debug.inspect_array_sharding(y, callback=lambda s, names=names, shape=y.shape: seen.append(
        {{"names": names, "shape": list(shape), "shards": list(s.shard_shape(shape))}}))
    return y

lm._constrained = inspected
config = lm.LMConfig(logical_activations=True)
program = lm.make_program(config, lm.sharded_layout({sharding!r}))
laid = lay_out(jax.devices(), lambda: program, 0, [])
compile_step(laid, 0, 2, [])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("sharding", ["fsdp", "fsdp_tp"])
def test_the_example_lm_s_activation_constraints_are_in_its_compiled_step(sharding):
    """The example LM with logical activation constraints, compiled as a
    worker compiles it on a slice of 4 devices: each constrained activation
    has the shards its rules ask for (batch over fsdp; the MLP's hidden
    units over tensor under fsdp_tp). Read from the compiled step with
    jax.debug.inspect_array_sharding. (A process of its own: 4 devices.)"""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-c", LM_TRACE.format(root=root, sharding=sharding)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    fsdp = 4 if sharding == "fsdp" else 2
    mlp = [s for s in seen if s["names"][-1] == "activation_mlp"]
    embed = [s for s in seen if s["names"][-1] == "activation_embed"]
    assert mlp and embed, seen
    for s in embed:  # [batch, length, embed]: the batch split over fsdp, the rest whole
        assert s["shards"] == [s["shape"][0] // fsdp, *s["shape"][1:]], s
    for s in mlp:  # [batch, length, mlp]: the hidden units over tensor too under fsdp_tp
        tensor = 2 if sharding == "fsdp_tp" else 1
        assert s["shards"] == [s["shape"][0] // fsdp, s["shape"][1], s["shape"][2] // tensor], s
