"""LoRA: adapters on a frozen base, their sharding, checkpoints, resume, merged export."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from jaxtron.config.schema import ConfigError, LoraConfig
from jaxtron.models import build_model, lora
from jaxtron.training.loop import run


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def base_run(tmp_path_factory):
    """A base model to adapt: a tiny run of 2 steps."""
    workdir = str(tmp_path_factory.mktemp("base"))
    run(tiny_config(train=dict(steps=2), checkpoint=dict(every=0)), workdir, use_tqdm=False,
        devices=jax.devices()[:1])
    return workdir


def _lora_cfg(base: str, mesh=None, dropout: float = 0.0, **train):
    return tiny_config(mesh, train=dict(steps=4, init_from=base, **train), checkpoint=dict(every=2, async_save=False),
                       lora=dict(rank=4, alpha=8.0, targets="q,v,o,down", dropout=dropout))


def _flat(params) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _adapted_model(cfg, seed: int = 1):
    """The tiny model with adapters whose B is random (not zero), so they change what it computes."""
    model = lora.add_adapters(build_model(cfg.model, cfg.execution, 0), cfg.lora, 0)
    state = nnx.state(model, lora.Adapter)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    randomised = jax.tree.map(lambda v: v + 0.05 * jax.random.normal(next(keys), v.shape), state)
    nnx.update(model, randomised)
    return model


def test_adapters_carry_their_weights_logical_axes_and_start_at_zero():
    from jaxtron.parallel.sharding import logical_names

    cfg = tiny_config()
    model = lora.add_adapters(build_model(cfg.model, cfg.execution, 0), LoraConfig(rank=4, targets="q_proj,o,down"), 0)
    attn, mlp = model.layers.attn, model.layers.mlp
    assert logical_names(attn.wq.lora_a) == ("layers", "embed", "lora_rank")
    assert logical_names(attn.wq.lora_b) == ("layers", "lora_rank", "heads", "head_dim")
    assert logical_names(attn.wo.lora_a) == ("layers", "heads", "head_dim", "lora_rank")
    assert logical_names(attn.wo.lora_b) == ("layers", "lora_rank", "embed")
    assert logical_names(mlp.wo.lora_a) == ("layers", "mlp", "lora_rank")
    assert attn.wq.lora_b.get_value().shape == (2, 4, 4, 16) and not np.any(attn.wq.lora_b.get_value())
    assert attn.wk.lora_a is None and mlp.wi_up.lora_a is None
    # B = 0: the adapted model computes what its base does
    base = build_model(cfg.model, cfg.execution, 0)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(1, 16) % 256
    np.testing.assert_array_equal(np.asarray(model(tokens).logits()), np.asarray(base(tokens).logits()))


@pytest.mark.parametrize("targets, message", [
    ("q,bogus", "names 'bogus', which is no projection"),
    ("q_a", "names 'q_a', but this model has no such projection"),
])
def test_a_target_that_names_no_projection_is_refused(targets, message):
    cfg = tiny_config()
    with pytest.raises(ConfigError, match=message):
        lora.add_adapters(build_model(cfg.model, cfg.execution, 0), LoraConfig(rank=2, targets=targets), 0)


@pytest.mark.slow
def test_merged_weights_compute_the_adapted_models_logits():
    """Folding W + (alpha / rank) A B equals running the adapters beside W (fp32 logits to 1e-5), for dense and
    latent attention and the MLP."""
    from test_generate import FAMILIES

    for family, targets in (("llama", "q,k,v,o,gate,up,down"), ("deepseek_v3", "q_a,q_b,kv_a,kv_b,o,down")):
        cfg = tiny_config(model=FAMILIES[family], train=dict(init_from="unused"),
                          lora=dict(rank=3, alpha=6.0, targets=targets))
        model = _adapted_model(cfg)
        tokens = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 7) % 256
        adapted = np.asarray(model(tokens).logits())
        merged = lora.merged(_flat(nnx.state(model, nnx.Param)), cfg.lora)
        assert not any(lora.is_adapter(k) for k in merged)
        plain = build_model(cfg.model, cfg.execution, 0)
        state = nnx.state(plain, nnx.Param)
        from jaxtron.checkpoint.params import nest
        nnx.replace_by_pure_dict(state, nest({k: jnp.asarray(v) for k, v in merged.items()}))
        nnx.update(plain, state)
        base = np.asarray(build_model(cfg.model, cfg.execution, 0)(tokens).logits())
        assert np.abs(adapted - base).max() > 1e-3, family  # the adapters do change the model
        np.testing.assert_allclose(np.asarray(plain(tokens).logits()), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_trains_the_adapters_alone_and_saves_only_them(base_run, tmp_path):
    """The base stays bit-identical, every adapter moves, the optimizer holds moments for the adapters only (a small
    fraction of full fine-tuning's), and checkpoints hold the adapters (plus optimizer state) alone."""
    from jaxtron.checkpoint.params import restore_params
    from jaxtron.training import state as state_lib

    cfg = _lora_cfg(base_run)
    summary = run(cfg, str(tmp_path / "lora"), use_tqdm=False, devices=jax.devices()[:1])
    after = _flat(summary.state.params)
    setup = state_lib.setup(cfg, "xla", {})
    abstract = setup.abstract_state.params
    base_paths = {p for p, v in nnx.to_flat_state(abstract) if not isinstance(v, lora.Adapter)}
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    keep = lambda path, _: path in base_paths
    base = _flat(restore_params(base_run, nnx.filter_state(abstract, keep),
                                 jax.tree.map(lambda _: cpu, nnx.filter_state(abstract, keep))))
    adapters = {k: v for k, v in after.items() if lora.is_adapter(k)}
    assert len(adapters) == 8 and set(base) == set(after) - set(adapters)
    for k, v in base.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)
    assert all(np.any(v) for k, v in adapters.items() if k.endswith(".lora_b"))  # B left zero
    moments = sum(x.size for x in jax.tree.leaves(summary.state.opt_state) if x.ndim)
    full = state_lib.setup(tiny_config(), "xla", {})
    full_moments = sum(x.size for x in jax.tree.leaves(full.abstract_state.opt_state) if x.ndim)
    assert moments == 2 * sum(v.size for v in adapters.values()) and moments < 0.1 * full_moments
    saved = os.path.join(tmp_path, "lora", "checkpoints", "4", "state")
    import orbax.checkpoint as ocp
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        tree = checkpointer.metadata(saved).item_metadata.tree
    names = {".".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}
    assert names and all("'lora_a'" in n or "'lora_b'" in n for n in names), names
    # the gradients the step computes are the adapters' alone
    from jaxtron.data.loader import SyntheticSource
    from jaxtron.training.step import gradients
    batch = {k: jnp.asarray(v) for k, v in SyntheticSource(256, cfg.data.seq_len, 0).rows(np.arange(8)).items()}
    grads = gradients(setup, summary.state.params, batch)[0]
    assert set(_flat(grads)) == set(adapters) and all(np.any(g) for g in _flat(grads).values())


@pytest.mark.slow
# both in the extended tier (the first tier's time is close to its limit); 0.0: as the other tests
@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.extended),
                                     pytest.param(0.2, marks=pytest.mark.extended)])
def test_a_lora_run_resumes_bit_exactly_and_matches_on_a_mesh(base_run, tmp_path, dropout):
    """Stopped after step 2 and resumed, a LoRA run ends with the same adapters as one that ran straight through;
    on fsdp=2 x tensor=2 its losses equal one device's; with dropout too (the masks are the step's)."""
    import shutil

    one = jax.devices()[:1]
    straight = run(_lora_cfg(base_run, dropout=dropout), str(tmp_path / "run"), use_tqdm=False, devices=one)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if the run had died right after saving step 2
    resumed = run(_lora_cfg(base_run, dropout=dropout), str(tmp_path / "run"), use_tqdm=False, devices=one)
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history[2:]]
    got = _flat(resumed.state.params)
    for k, want in _flat(straight.state.params).items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)
    for a, b in zip(jax.tree.leaves(straight.state.opt_state), jax.tree.leaves(resumed.state.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # 4 devices: on 8, XLA:CPU runs this program's independent collectives concurrently and, on 2 cores, can starve
    # one device's thread until its rendezvous times out (an abort, seen under load)
    sharded = run(_lora_cfg(base_run, dict(fsdp=2, tensor=2), dropout=dropout), str(tmp_path / "mesh"),
                  use_tqdm=False, devices=jax.devices()[:4])
    np.testing.assert_allclose([h["loss"] for h in sharded.history], [h["loss"] for h in straight.history],
                               rtol=1e-5)
    a = sharded.state.params["layers"]["attn"]["wq"]["lora_b"].get_value()
    assert "tensor" in str(a.sharding.spec)  # B of the query is split over the heads, as the query is
    if dropout:  # the masks change the training, and each layer has its own seed
        plain = run(_lora_cfg(base_run), str(tmp_path / "plain"), use_tqdm=False, devices=one)
        assert [h["loss"] for h in plain.history][1:] != [h["loss"] for h in straight.history][1:]
        attn = straight.state.params["layers"]["attn"]
        seeds = np.asarray(attn["wq"]["lora_seed"].get_value())
        assert seeds.shape == (2,) and len(set(seeds.tolist())) == 2
        # the module's layers numbered once: its projections tell their masks apart by their own tags
        np.testing.assert_array_equal(np.asarray(attn["wv"]["lora_seed"].get_value()), seeds)
        mlp = np.asarray(straight.state.params["layers"]["mlp"]["wo"]["lora_seed"].get_value())
        assert not set(mlp.tolist()) & set(seeds.tolist())


@pytest.mark.slow
@pytest.mark.extended  # LoRA on a mesh: the first tier's resume check; pipelines: test_pipeline's
def test_a_lora_run_on_a_pipeline_trains_like_one_device(base_run, tmp_path):
    """The adapters are stacked with their layers, so the fill-drain pipeline stages them as it stages the base.
    (Without dropout: its masks are drawn per microbatch, and a pipeline's microbatches are other arrays.)"""
    one = run(_lora_cfg(base_run), str(tmp_path / "one"), use_tqdm=False, devices=jax.devices()[:1])
    staged = run(_lora_cfg(base_run, dict(pipeline=2, fsdp=2)), str(tmp_path / "staged"), use_tqdm=False,
                 devices=jax.devices()[:4])
    np.testing.assert_allclose([h["loss"] for h in staged.history], [h["loss"] for h in one.history], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.integration
def test_a_lora_run_generates_and_exports_its_merged_model(base_run, tmp_path, capsys):
    """`jaxtron generate` and `convert to-hf` read a LoRA run as its base with the adapters folded in; the exported
    model, imported again, computes the adapted model's logits."""
    from jaxtron import cli
    from jaxtron.checkpoint.params import nest
    from jaxtron.interop import convert

    workdir = str(tmp_path / "lora")
    summary = run(_lora_cfg(base_run), workdir, use_tqdm=False, devices=jax.devices()[:1])
    cfg = _lora_cfg(base_run)
    model = lora.add_adapters(build_model(cfg.model, cfg.execution, 0), cfg.lora, 0)
    nnx.update(model, summary.state.params)
    tokens = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 5) % 256
    want = np.asarray(model(tokens).logits())
    assert convert.main(["to-hf", workdir, str(tmp_path / "hf")]) == 0
    convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    model_cfg, params = convert.load(str(tmp_path / "back"))
    plain = build_model(model_cfg, cfg.execution, 0)
    state = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(state, nest({k: jnp.asarray(v) for k, v in params.items()}))
    nnx.update(plain, state)
    np.testing.assert_allclose(np.asarray(plain(tokens).logits()), want, rtol=1e-5, atol=1e-5)
    assert cli.main(["generate", "--run", workdir, "--prompt", "def ", "--max-new-tokens", "3",
                     "--tokenizer", "byte"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow
@pytest.mark.integration
def test_bad_lora_configs_are_one_sentence_and_exit_2(tmp_path, capsys):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = [(["--config.lora.rank=4"], "config field 'train.init_from' is empty but lora.rank is 4"),
             (["--config.lora.rank=4", "--config.train.init_from=/nowhere", "--config.lora.targets=q,wq"],
              "names 'wq', which is no projection"),
             (["--config.lora.rank=4", "--config.train.init_from=/nowhere", "--config.lora.targets=gate",
               "--config.model.activation=gelu"], "names 'gate', but this model has no such projection")]
    for extra, message in cases:
        done = subprocess.run([sys.executable, "train.py", f"--config={repo}/configs/default.py",
                               f"--workdir={tmp_path}/w", "--config.data.source=synthetic",
                               "--config.data.prepare=", *extra],
                              cwd=repo, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
