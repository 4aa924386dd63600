"""The pipeline schedule: any stage count, virtual stages and microbatch count give the layers-in-order result,
forward and gradients, on a mesh whose pipeline axis splits the stages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxtron.training.pipeline import bubble_fraction, check_schedule, pipeline, storage_order


def _stage(layers, x):
    """P layers, each tanh(x w + b), in order."""
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w["w"] + w["b"]), None), x, layers)[0]


def _loss(out):
    return jnp.sum(jnp.sin(out) * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)


@pytest.mark.parametrize("stages,virtual,microbatches", [(2, 1, 2), (4, 1, 4), (4, 1, 6), (2, 2, 3), (4, 2, 5),
                                                         (2, 3, 2)])
def test_the_schedule_equals_the_layers_in_order(stages, virtual, microbatches):
    per = 2
    num_layers = stages * virtual * per
    keys = jax.random.split(jax.random.key(stages * 100 + virtual * 10 + microbatches), 3)
    params = {"w": jax.random.normal(keys[0], (num_layers, 16, 16)) * 0.4,
              "b": jax.random.normal(keys[1], (num_layers, 16)) * 0.1}
    inputs = jax.random.normal(keys[2], (microbatches, 4, 16))
    order = storage_order(num_layers, stages, virtual)
    assert sorted(order) == list(range(num_layers)) and (virtual > 1 or list(order) == list(range(num_layers)))

    def reference(params, inputs):  # each microbatch through the layers in their natural order
        return jax.vmap(lambda x: _stage(params, x))(inputs)

    want = reference(params, inputs)
    want_grads = jax.grad(lambda p, x: _loss(reference(p, x)), argnums=(0, 1))(params, inputs)

    mesh = jax.make_mesh((stages, 8 // stages), ("pipeline", "data"), axis_types=(AxisType.Auto,) * 2)
    stacked = jax.device_put({k: v[order] for k, v in params.items()},
                             NamedSharding(mesh, PartitionSpec("pipeline")))
    inputs_on_mesh = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec(None, "data")))
    with jax.set_mesh(mesh):
        run = jax.jit(lambda st, x: pipeline(_stage, st, x, stages, virtual))
        got = run(stacked, inputs_on_mesh)
        grads = jax.jit(jax.grad(lambda st, x: _loss(pipeline(_stage, st, x, stages, virtual)), argnums=(0, 1)))(
            stacked, inputs_on_mesh)
        hlo = run.lower(stacked, inputs_on_mesh).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for k in params:  # the gradient of the stored stack is that of each layer, in storage order
        np.testing.assert_allclose(grads[0][k], want_grads[0][k][order], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], want_grads[1], rtol=1e-5, atol=1e-5)
    assert "collective-permute" in hlo  # activations move between stages by permutes


def test_sizes_the_schedule_cannot_run_are_named():
    with pytest.raises(ValueError, match="6 layers do not split into 4 stages x 1 virtual stages"):
        check_schedule(6, 4, 1, 4)
    with pytest.raises(ValueError, match="8 layers do not split into 2 stages x 3 virtual stages"):
        check_schedule(8, 2, 3, 4)
    with pytest.raises(ValueError, match="3 microbatches cannot keep 4 stages busy; use at least 4"):
        check_schedule(8, 4, 1, 3)
    check_schedule(8, 4, 2, 4)


def test_the_bubble_shrinks_with_microbatches_and_virtual_stages():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 4, virtual_stages=2) == pytest.approx(3 / 11)
