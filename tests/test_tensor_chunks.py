"""A block's projections in chunks of the rows (execution.tensor_chunks): each chunk is split over the tensor group
as the residual stream is, the pieces go back in order, and training equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESHES, losses, tiny_config

from jaxtron.models import tensor_chunks
from jaxtron.parallel.mesh import full_sizes, make_mesh
from jaxtron.parallel.sharding import constrain
from jaxtron.training.loop import run

STREAM = ("activation_batch", "activation_residual_length", "activation_embed")


def test_a_chunk_takes_the_same_rows_of_every_shard_and_the_pieces_join_in_order():
    """On sequence=2 x tensor=2 the stream is cut in 4 shards of 8 rows; chunk j of 2 holds rows 4j..4j+3 of each,
    and ``over_chunks`` of a token-wise function equals it on the whole."""
    mesh = make_mesh(full_sizes(dict(data=2, sequence=2, tensor=2)))
    x = jnp.arange(2 * 32 * 4, dtype=jnp.float32).reshape(2, 32, 4)
    with jax.set_mesh(mesh):
        assert tensor_chunks.shards() == 4 and tensor_chunks.usable(2, 32) == 2
        assert tensor_chunks.usable(2, 36) == 1  # 9 rows a shard: not in 2 equal chunks
        assert tensor_chunks.usable(2, 32, whole_rows=True) == 1
        taken = jax.jit(lambda v: tensor_chunks._take(constrain(v, STREAM), 1, 2))(x)
        rows = np.concatenate([np.arange(8 * s + 4, 8 * s + 8) for s in range(4)])
        np.testing.assert_array_equal(np.asarray(taken), np.asarray(x)[:, rows])
        joined = jax.jit(lambda v: tensor_chunks.over_chunks(
            lambda r: constrain(jnp.tanh(r) * 2.0, STREAM), 2, constrain(v, STREAM)))(x)
    np.testing.assert_array_equal(np.asarray(joined), np.asarray(jnp.tanh(x) * 2.0))
    assert tensor_chunks.usable(2, 32) == 1  # no mesh: no tensor group


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    return run(tiny_config(dict(fsdp=1)), str(tmp_path_factory.mktemp("one")), use_tqdm=False,
               devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.extended  # the first tier checks the chunks' rows and order above
@pytest.mark.parametrize("mesh_name", ["data2_fsdp2_tensor2", "fsdp2_sequence2_tensor2"])
def test_losses_with_the_projections_in_chunks_match_one_device(mesh_name, one_device_run, tmp_path, monkeypatch):
    """3 float32 steps with 2 chunks equal one device; the chunks really ran (each block cut its rows 3 ways:
    queries, keys and values; the attention's output; the MLP)."""
    cuts = []
    take = tensor_chunks._take
    monkeypatch.setattr(tensor_chunks, "_take", lambda x, j, chunks: cuts.append(chunks) or take(x, j, chunks))
    summary = run(tiny_config(MESHES[mesh_name], execution=dict(tensor_chunks=2)), str(tmp_path), use_tqdm=False)
    assert cuts and set(cuts) == {2}
    np.testing.assert_allclose(losses(summary), losses(one_device_run), rtol=1e-5)
