"""Every parameter (and optimizer moment) is sharded exactly as the rules table says, from init on."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import MESHES, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron.parallel import sharding
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib

# Written out by hand from the rules: which mesh axis shards each dimension of each parameter (the weights outside
# the experts split their embedding width over fsdp and the expert axis together).
FS = ("fsdp", "expert")
EXPECTED = {
    "embedding": P("tensor", FS),
    "head": P(FS, "tensor"),
    "final_norm.scale": P(None),
    "layers.attn.wq.weight": P("pipeline", FS, "tensor", None),
    "layers.attn.wk.weight": P("pipeline", FS, "tensor", None),
    "layers.attn.wv.weight": P("pipeline", FS, "tensor", None),
    "layers.attn.wo.weight": P("pipeline", "tensor", None, FS),
    "layers.attn_norm.scale": P("pipeline", None),
    "layers.mlp_norm.scale": P("pipeline", None),
    "layers.mlp.wi_gate.weight": P("pipeline", FS, "tensor"),
    "layers.mlp.wi_up.weight": P("pipeline", FS, "tensor"),
    "layers.mlp.wo.weight": P("pipeline", "tensor", FS),
}


def _flat(tree):
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(tree)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_parameters_are_sharded_by_the_rules_from_init(mesh_name):
    cfg = tiny_config(MESHES[mesh_name])
    sizes = check_devices(cfg, 8)
    mesh = make_mesh(sizes)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, "xla")
        shardings = state_lib.state_shardings(mesh, setup.abstract_state)
        state = state_lib.init_state(cfg, "xla", shardings)
    params = _flat(state.params)
    assert set(params) == set(EXPECTED)
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = (scale_by_adam, ...)
    moments = {"mu": _flat(adam.mu), "nu": _flat(adam.nu)}
    for name, var in params.items():
        array = var.get_value()
        spec = EXPECTED[name]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (name, array.sharding)
        # each device holds only its shard: the global shape divided by the sizes of the sharding axes
        shard_shape = tuple(dim // math.prod(sizes[a] for a in sharding.spec_axes(spec, d))
                            for d, dim in enumerate(array.shape))
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, name
        for moment in moments.values():
            other = moment[name].get_value()
            assert other.sharding.is_equivalent_to(array.sharding, array.ndim), name


def test_logical_rules_never_reuse_a_mesh_axis():
    # batch takes data, fsdp and expert; an 'embed' dimension later in the same array must not take fsdp again
    assert sharding.logical_to_spec(("activation_batch", "embed")) == P(("data", "fsdp", "expert"), None)
    # an expert's weights keep the expert axis for their experts, their embedding width fsdp alone
    assert sharding.logical_to_spec(("experts", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_spec(("embed", "mlp")) == P(("fsdp", "expert"), "tensor")
    assert sharding.logical_to_spec(("activation_batch", "activation_length", "activation_vocab")) == \
        P(("data", "fsdp", "expert"), "sequence", "tensor")
    with pytest.raises(KeyError, match="no rule"):
        sharding.logical_to_spec(("not_a_logical_axis",))


def test_every_logical_name_used_by_the_model_has_a_rule():
    cfg = tiny_config()
    setup = state_lib.setup(cfg, "xla")
    names = {n for _, v in nnx.to_flat_state(setup.abstract_state.params) for n in sharding.logical_names(v)}
    assert names <= {name for name, _ in sharding.RULES}
    assert {"layers", "embed", "heads", "kv_heads", "mlp", "vocab", "norm"} <= names


def test_constrain_holds_an_array_in_its_logical_names_a_spec_or_its_first_dimensions_alone():
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    x = jax.device_put(jax.numpy.ones((8, 16)), NamedSharding(mesh, P()))

    def held(layout):
        with jax.set_mesh(mesh):
            return jax.jit(lambda a: sharding.constrain(a * 2, layout))(x).sharding

    want = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    assert held(("activation_batch", "activation_vocab")).is_equivalent_to(want, 2)
    assert held(P(("data", "fsdp"), "tensor")).is_equivalent_to(want, 2)
    assert held(P("tensor", None)).is_equivalent_to(NamedSharding(mesh, P("tensor", None)), 2)
    # a trailing ... holds the first dimension only; XLA places the other (here: whole, as its input)
    assert held(("activation_batch", ...)).spec[0] in (("data", "fsdp"), ("data", "fsdp", "expert"))
    assert sharding.constrain(x, ("activation_batch", None)) is x  # no mesh set: nothing to hold


@pytest.mark.parametrize("mesh, whole, want", [
    (dict(data=2, fsdp=2, tensor=2), False, ("data",)),  # fsdp splits the weights: its devices are no replicas
    (dict(data=2, fsdp=2, tensor=2), True, ("data", "fsdp")),  # weights gathered over fsdp for the whole step
    (dict(data=1, fsdp=8), False, ()),
    (dict(data=4, fsdp=1, expert=2), False, ("data",)),  # a dense weight splits over expert as over fsdp
    (dict(data=4, fsdp=1, expert=2), True, ("data", "expert")),
])
def test_the_replicas_are_the_batch_axes_that_split_no_weight(mesh, whole, want):
    cfg = tiny_config(mesh)
    sizes = check_devices(cfg, 8)
    params = state_lib.setup(cfg, "xla").abstract_state.params
    assert sharding.replica_axes(params, sizes, whole) == want


def test_a_replicas_dimension_takes_its_axes_and_the_rest_map_onto_the_others():
    # per-replica accumulators [R, rows, width]: the rows split over what the replicas leave of the batch's axes
    assert sharding.replica_spec(("data",), ("activation_batch", None), 3) == P(("data",), ("fsdp", "expert"), None)
    # a pipeline's [stages, R, periods, embed, mlp]: the periods whole between, the weights as their rules say
    assert sharding.replica_spec(("data",), ("embed", "mlp"), 5, staged=True) == \
        P("pipeline", ("data",), None, ("fsdp", "expert"), "tensor")
    # weights held whole over the batch's axes (pipeline.fsdp_gather='step'): only the tensor split is left
    assert sharding.replica_spec(("data", "fsdp"), ("embed", "mlp"), 3, whole=True) == \
        P(("data", "fsdp"), None, "tensor")
    assert sharding.replica_spec((), ("embed",), 2) == P(None, ("fsdp", "expert"))


def test_batch_is_sharded_over_data_fsdp_expert_and_length_over_sequence():
    mesh = make_mesh(dict(data=2, fsdp=1, sequence=2, expert=2, tensor=1))
    spec = sharding.batch_sharding(mesh).spec
    assert spec == P(("data", "fsdp", "expert"), "sequence")
    x = jax.device_put(jax.numpy.zeros((8, 16)), sharding.batch_sharding(mesh))
    assert {s.data.shape for s in x.addressable_shards} == {(8 // 4, 16 // 2)}


def test_sharding_table_lists_every_parameter_with_its_physical_sharding():
    cfg = tiny_config(dict(fsdp=4, tensor=2))
    mesh = make_mesh(check_devices(cfg, 8))
    setup = state_lib.setup(cfg, "xla")
    text = sharding.sharding_table(mesh, setup.abstract_state.params)
    for name, spec in EXPECTED.items():
        line = next(l for l in text.splitlines() if l.startswith(name + " "))
        assert line.rstrip().endswith(str(spec)), line
    assert math.prod(mesh.shape.values()) == 8


@pytest.mark.slow
def test_initialisation_never_materialises_the_full_state_on_one_device():
    cfg = tiny_config(dict(fsdp=8), model=dict(embed_dim=256, mlp_dim=1024, num_layers=4))
    mesh = make_mesh(check_devices(cfg, 8))
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, "xla")
        shardings = state_lib.state_shardings(mesh, setup.abstract_state)
        sharded = state_lib.sharded_init(cfg, "xla", shardings).lower().compile().memory_analysis()
        replicated = state_lib.sharded_init(cfg, "xla", None).lower().compile().memory_analysis()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state))
    per_device = sharded.output_size_in_bytes + sharded.temp_size_in_bytes
    assert sharded.output_size_in_bytes < 0.15 * total  # ~1/8 of params + moments
    assert per_device < 0.25 * total  # working memory included: nothing close to a full copy
    assert replicated.output_size_in_bytes >= total  # the check can fail: without shardings it is all there


def _nodes_of(mesh_devices, node_of):
    return np.vectorize(lambda d: node_of[d])(mesh_devices)


@pytest.mark.parametrize("order", ["block", "cyclic"])
def test_across_nodes_tensor_stays_inside_a_node_and_data_crosses(order):
    from jaxtron.parallel.mesh import arrange
    nodes, per_node = 4, 8
    devices = list(range(nodes * per_node))
    # block: processes 0-7 on node 0, ...; cyclic: consecutive processes on different nodes
    node_of = [d // per_node if order == "block" else d % nodes for d in devices]
    grid = arrange(devices, dict(data=2, fsdp=4, sequence=1, expert=1, tensor=4), node_of)[0]  # pipeline=1
    assert sorted(grid.flatten().tolist()) == devices
    where = _nodes_of(grid, node_of)
    for d in range(2):  # every tensor group lies inside one node
        for f in range(4):
            assert len(set(where[d, f, 0, 0, :].tolist())) == 1
    assert set(where[0].flatten().tolist()).isdisjoint(where[1].flatten().tolist())  # data replicas: other nodes
    assert len(set(where[0, :, 0, 0, 0].tolist())) == 2  # fsdp spans 2 nodes within a replica
    # pipeline stages are the outermost axis: with 2 stages each holds the nodes of its own half
    staged = _nodes_of(arrange(devices, dict(pipeline=2, data=2, fsdp=2, tensor=4), node_of), node_of)
    assert set(staged[0].flatten().tolist()).isdisjoint(staged[1].flatten().tolist())
    assert all(len(set(staged[p, d, f, 0, 0, :].tolist())) == 1 for p in range(2) for d in range(2) for f in range(2))


def test_one_node_keeps_the_device_order_and_bad_layouts_are_errors():
    from jaxtron.config.schema import ConfigError
    from jaxtron.parallel.mesh import arrange, split_over_nodes
    sizes = dict(data=2, fsdp=2, sequence=1, expert=1, tensor=2)
    assert arrange(list(range(8)), sizes, [0] * 8).flatten().tolist() == list(range(8))
    assert split_over_nodes(dict(data=2, fsdp=8, sequence=1, expert=1, tensor=8), 4) == \
        dict(pipeline=1, data=2, fsdp=2, sequence=1, expert=1, tensor=1)
    assert split_over_nodes(dict(pipeline=4, data=2, fsdp=8, tensor=8), 8)["pipeline"] == 4  # stages first
    with pytest.raises(ConfigError, match="cannot be laid over 3 nodes"):
        split_over_nodes(sizes, 3)
    with pytest.raises(ConfigError, match=r"nodes have different device counts \(a: 5, b: 3\)"):
        arrange(list(range(8)), sizes, ["a"] * 5 + ["b"] * 3)


def test_no_mesh_axis_is_named_outside_the_parallel_package():
    """Models, ops, training, data, checkpoints and metrics speak logical names only; a mesh axis written out there
    would escape the rules table. The config validates mesh degrees and the planner searches them, so those two
    may name axes; the strings the checkpoint uses for its own items are not mesh axes."""
    import ast
    import pathlib

    axes = {"pipeline", "data", "fsdp", "sequence", "expert", "tensor"}
    package = pathlib.Path(sharding.__file__).parents[1]
    allowed = {"parallel", "config", "planning"}
    checked, found = 0, []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in allowed:
            continue
        checked += 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in axes:
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.value!r}")
    found = [f for f in found if not (f.startswith(("checkpoint/train_state.py", "metrics/summary.py"))
                                      and f.endswith("'data'"))]
    assert checked > 30 and not found, found
