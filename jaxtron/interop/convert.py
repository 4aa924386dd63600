"""Convert between Hugging Face model directories and jaxtron checkpoints (Llama, Qwen3 dense and MoE, Mixtral and
DeepSeek-V3; each family is declared in ``jaxtron/families/``).

    jaxtron convert from-hf HF_DIR OUT_DIR    # config.json + safetensors -> OUT_DIR/params, config.py
    jaxtron convert to-hf CKPT_DIR OUT_DIR    # a converted model or a training run -> config.json + safetensors

Import reads one tensor at a time into disk-backed buffers of the stacked parameters, so host memory holds
one tensor plus what the page cache keeps, not the model. Nothing is ever loaded with pickle.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
from typing import Any

import numpy as np

from jaxtron import families
from jaxtron.checkpoint import layouts
from jaxtron.common.files import staged_directory, user_path
from jaxtron.config.schema import Config, ConfigError, ExecutionConfig, ModelConfig
from jaxtron.data.store import first_manifest
from jaxtron.interop.hf import safetensors as st
from jaxtron.interop.hf import tokenizer as hf_tokenizer
from jaxtron.interop.hf.tensor_plan import check_plan

log = logging.getLogger(__name__)

SHARD_BYTES = 5 * 2**30  # Hugging Face's customary shard size


def _read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise st.FormatError(f"'{hf_dir}' has no config.json; pass a Hugging Face model directory.") from None
    except (OSError, ValueError) as e:
        raise st.FormatError(f"'{path}' is not readable JSON ({e}).") from None
    if not isinstance(config, dict):
        raise st.FormatError(f"'{path}' is not a JSON object.")
    return config


def _abstract_variables(cfg: ModelConfig) -> dict[str, Any]:
    """{dotted path: abstract nnx Variable (shape, dtype, logical names)} of the model's parameters."""
    from flax import nnx

    from jaxtron.models import build_model
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg, ExecutionConfig(), 0)), nnx.Param)
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def _abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """{dotted path: ShapeDtypeStruct} of the model's parameters (nothing allocated)."""
    return {path: var.get_value() for path, var in _abstract_variables(cfg).items()}


def _config_file(cfg: ModelConfig, train: dict[str, Any], out_dir: str) -> str:
    """A config file for train.py: this model, fine-tuning from OUT_DIR's parameters (``train``: fields of the
    train section that the Hugging Face config sets)."""
    import dataclasses

    def differing(obj, defaults) -> dict[str, Any]:
        """The fields of ``obj`` that differ from ``defaults``; a group as a dict of its own differing fields."""
        out = {}
        for f in dataclasses.fields(obj):
            value, default = getattr(obj, f.name), getattr(defaults, f.name)
            if value != default:
                out[f.name] = differing(value, default) if dataclasses.is_dataclass(value) else value
        return out

    model = {"family": cfg.family, **differing(cfg, ModelConfig())}  # named, as every config names it
    train = dict(init_from=os.path.abspath(out_dir), steps=1000, global_batch_size=8, eval_batches=0, **train)
    return f'''"""{cfg.name}, converted from Hugging Face by `jaxtron convert from-hf`.

Training with this file starts from the converted parameters (train.init_from) with a fresh optimizer.
Data is synthetic until data.source/data.path name a token store of the model's tokenizer.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = {model!r}
    c.execution = dict(dtype="bfloat16")  # the training compute dtype on GPUs; parameters stay float32
    c.train = {train!r}
    c.optimizer = dict(learning_rate=1e-5, warmup_steps=50, weight_decay=0.0)
    c.data = dict(source="synthetic", seq_len={min(cfg.max_seq_len, 4096)})
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
'''


def from_hf(hf_dir: str, out_dir: str) -> ModelConfig:
    """Imports a Hugging Face directory; writes OUT_DIR/params (orbax) and OUT_DIR/config.py."""
    hf = _read_hf_config(hf_dir)
    files = st.ModelFiles(hf_dir)
    cfg = families.model_config(hf, name=os.path.basename(os.path.normpath(hf_dir)), tensor_names=set(files.names()))
    plan = list(families.tensors(cfg, hf))
    check_plan(cfg, plan, files, hf_dir, hf.get("model_type"))
    _check_output(out_dir)
    with staged_directory(out_dir) as staging:
        _write_params(cfg, plan, files, staging)
        with open(os.path.join(staging, "config.py"), "w") as f:
            f.write(_config_file(cfg, families.train_fields(hf), out_dir))
        # the tokenizer travels with the model (``jaxtron generate`` finds it there)
        hf_tokenizer.export(hf_dir, None, cfg.max_seq_len, staging)
    return cfg


def _check_output(out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output directory '{out_dir}' is a file; choose a new directory.")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"output directory '{out_dir}' is not empty; choose a new one.")


def _write_params(cfg: ModelConfig, plan: list, files: st.ModelFiles, out_dir: str) -> None:
    """``out_dir/params`` from the tensors of ``files`` as ``plan`` places them."""
    shapes = _abstract_params(cfg)
    staging = os.path.join(out_dir, ".buffers")
    os.makedirs(staging)
    buffers = {p: np.lib.format.open_memmap(os.path.join(staging, p + ".npy"), mode="w+", dtype=np.float32,
                                            shape=s.shape) for p, s in shapes.items()}
    filled = {p: 0 for p in shapes}
    depth = {p: len(i) for t in plan for p, i in t.targets()}  # the stacking dimensions of each parameter
    for t in plan:
        if not t.copy:
            for (param, index), value in zip(t.targets(), t.values(files.read), strict=True):
                buffers[param][index] = value  # one copy: into the disk buffer
                filled[param] += 1
    for t in plan:  # a second copy of a parameter (DeepSeek's MTP embedding and head) must equal the first
        if t.copy and not np.array_equal(t.values(files.read)[0], buffers[t.param][t.index]):
            raise st.FormatError(f"tensor '{t.hf_name}' differs from the model's own {t.param}; jaxtron's "
                                 "multi-token prediction shares the model's embedding and output head.")
    for p, s in shapes.items():  # every slice of every parameter came from exactly one tensor
        slices = math.prod(s.shape[:depth[p]])
        assert filled[p] == slices, (p, filled[p], slices)
    from jaxtron.checkpoint.params import save_params
    save_params(out_dir, buffers, depth)
    del buffers
    shutil.rmtree(staging)


def _run_config(ckpt_dir: str) -> tuple[Config, str | None]:
    """The config of a converted model, or of a training run with its newest intact checkpoint (verified here
    once: the callers read that step, they do not look for it again)."""
    from jaxtron.checkpoint.params import latest_run_state
    from jaxtron.config.loader import from_mapping, load_config
    if os.path.isfile(os.path.join(ckpt_dir, "config.py")):
        return load_config(os.path.join(ckpt_dir, "config.py")), None
    step_dir = latest_run_state(ckpt_dir)
    if step_dir is None:
        raise ConfigError(f"'{ckpt_dir}' is neither a converted model (config.py + params/) nor a training run "
                          "with checkpoints; pass one of those.")
    from jaxtron.checkpoint.params import saved_config
    from jaxtron.checkpoint.train_state import STORAGE_KEYS
    saved = saved_config(step_dir)
    for key in STORAGE_KEYS:  # how the checkpoint stores the state, not config fields; restore_params reads them
        saved.pop(key, None)
    return from_mapping(saved), step_dir


def load(ckpt_dir: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(model config, {dotted path: float32 array}) of a converted model or of a training run's latest
    checkpoint, on the host (the whole model)."""
    import jax
    from flax import nnx

    from jaxtron.checkpoint.params import restore_params
    from jaxtron.models import build_model
    ckpt_dir = os.path.abspath(ckpt_dir)  # orbax takes absolute paths only
    run_cfg, step_dir = _run_config(ckpt_dir)
    if run_cfg.lora.rank:  # the adapters merged into the base they were trained on
        from jaxtron.models import lora
        _, base = load(_lora_base(ckpt_dir, run_cfg))
        return run_cfg.model, lora.merged({**base, **_adapters(ckpt_dir, run_cfg, step_dir)}, run_cfg.lora)
    cfg = run_cfg.model
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(cfg, ExecutionConfig(), 0)), nnx.Param)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    params = restore_params(ckpt_dir, abstract, jax.tree.map(lambda _: cpu, abstract), step_dir)
    return cfg, {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _lora_base(ckpt_dir: str, run_cfg: Config) -> str:
    """The model a LoRA run adapted (its train.init_from), which must still be there."""
    base = os.path.expanduser(run_cfg.train.init_from)
    if not os.path.isdir(base):
        raise ConfigError(f"'{ckpt_dir}' holds LoRA adapters of the model in '{run_cfg.train.init_from}' "
                          "(train.init_from), which is not a directory here; run from where the run was started or "
                          "restore that model there.")
    return os.path.abspath(base)


def _adapters(ckpt_dir: str, run_cfg: Config, step_dir: str) -> dict[str, np.ndarray]:
    """{dotted path: float32 array} of a LoRA run's adapters (small: read whole), the layer stack in natural order."""
    import jax
    from flax import nnx

    from jaxtron.checkpoint.params import restore_params
    from jaxtron.models import build_model, lora

    def build():
        return lora.add_adapters(build_model(run_cfg.model, ExecutionConfig(), 0), run_cfg.lora, 0)

    abstract = nnx.state(nnx.eval_shape(build), lora.Adapter)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    params = restore_params(ckpt_dir, abstract, jax.tree.map(lambda _: cpu, abstract), step_dir)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


class _Merged:
    """A LoRA run's parameters for export: its base's, each adapted weight read whole with its adapters folded in."""

    def __init__(self, ckpt_dir: str, run_cfg: Config, step_dir: str):
        base = _lora_base(ckpt_dir, run_cfg)
        self.base = _source(base, *_run_config(base))
        self.adapters, self.lora, self.cached = _adapters(ckpt_dir, run_cfg, step_dir), run_cfg.lora, (None, None)

    def _projection(self, param: str) -> str | None:
        """The adapted projection whose weight ``param`` is (None: not adapted)."""
        projection = param.removesuffix(".weight")
        return projection if projection + ".lora_a" in self.adapters else None

    def whole(self, param: str) -> np.ndarray:
        projection = self._projection(param)
        if projection is None:
            return self.base.whole(param)
        from jaxtron.models import lora
        pair = {projection + k: self.adapters[projection + k] for k in (".lora_a", ".lora_b")}
        return lora.merged({param: self.base.whole(param), **pair}, self.lora)[param]

    def get(self, param: str, index: tuple[int, ...]) -> np.ndarray:
        if self._projection(param) is None:
            return self.base.get(param, index)
        if self.cached[0] != param:
            self.cached = (param, self.whole(param))
        return self.cached[1][index]


def _source(ckpt_dir: str, run_cfg: Config, step_dir: str | None):
    """Where export reads a checkpoint's parameters: slices, or a LoRA run's merged weights."""
    return _Merged(ckpt_dir, run_cfg, step_dir) if run_cfg.lora.rank else _Slices(ckpt_dir, run_cfg.model, step_dir)


class _Slices:
    """Reads the HF tensors' slices of a checkpoint: one slice at a time from a converted model, one whole
    parameter at a time (the last one kept) from a training run."""

    def __init__(self, ckpt_dir: str, cfg: ModelConfig, step_dir: str | None):
        from jaxtron.checkpoint.params import PARAMS_DIR, _manifest
        self.root = os.path.join(ckpt_dir, PARAMS_DIR)
        self.converted = os.path.isdir(self.root)
        self.manifest = _manifest(self.root) if self.converted else None
        self.item, self.cached = None if self.converted else os.path.join(step_dir, "state"), (None, None)
        self.shapes, self.layer_order, self.stacked, self.layout = None, None, set(), layouts.PARAM_LAYOUT
        if not self.converted:
            from jaxtron.checkpoint.params import saved_config, saved_layer_order
            from jaxtron.parallel.sharding import logical_names
            variables = _abstract_variables(cfg)
            self.shapes = {path: var.get_value() for path, var in variables.items()}
            self.layer_order = saved_layer_order(step_dir)
            self.layout = layouts.saved_layout(saved_config(step_dir))
            self.stacked = {path for path, var in variables.items() if logical_names(var)[:1] == ("layers",)}

    def whole(self, param: str) -> np.ndarray:
        """One parameter entire."""
        if not self.converted:
            return self._run_param(param)
        meta = self.manifest[layouts.stored_name(param, self.manifest)]
        k, shape = meta["split"], tuple(meta["shape"])
        return np.stack([self.get(param, i) for i in np.ndindex(*shape[:k])]).reshape(shape)

    def get(self, param: str, index: tuple[int, ...]) -> np.ndarray:
        from jaxtron.checkpoint.params import read_slice
        if self.converted:
            return read_slice(self.root, layouts.stored_name(param, self.manifest), index, self.manifest)
        if self.cached[0] != param:
            self.cached = (param, self._run_param(param))
        return self.cached[1][index]

    def _run_param(self, param: str) -> np.ndarray:
        import jax
        import orbax.checkpoint as ocp

        from jaxtron.checkpoint.params import _checkpointer, nest
        leaf = self.shapes[param]
        shape = leaf.shape
        if self.layer_order is not None and param in self.stacked:  # identity periods of an uneven split too
            from jaxtron.parallel.stages import stored_rows
            shape = (stored_rows(shape[0], self.layer_order), *shape[1:])
        stored = param if self.layout == layouts.PARAM_LAYOUT else ".".join(layouts.older(param.split(".")))
        key = "params." + stored + ".value"
        with _checkpointer() as checkpointer:
            restored = checkpointer.restore(self.item, args=ocp.args.PyTreeRestore(
                nest({key: jax.ShapeDtypeStruct(shape, leaf.dtype)}),
                restore_args=nest({key: ocp.RestoreArgs(restore_type=np.ndarray)}), partial_restore=True))
        for part in key.split("."):
            restored = restored[part]
        if self.layer_order is not None and param in self.stacked:
            from jaxtron.parallel.stages import to_natural
            return to_natural(np.asarray(restored), self.layer_order)  # stored stage-major for a pipeline
        return np.asarray(restored)


def to_hf(ckpt_dir: str, out_dir: str, dtype: str = "float32") -> dict:
    """Exports to config.json + safetensors (one file, or shards of SHARD_BYTES with an index). Tensors are
    written parameter by parameter, so host memory holds one slice (a converted model) or one parameter."""
    run_cfg, step_dir = _run_config(ckpt_dir)
    cfg = run_cfg.model
    hf = families.hf_config(cfg, run_cfg.train.router_aux_loss)
    hf["torch_dtype"] = dtype
    np_dtype = np.dtype(st.SAFETENSORS_DTYPES[{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]])
    _check_output(out_dir)
    source = _source(os.path.abspath(ckpt_dir), run_cfg, step_dir)
    plan = sorted(families.tensors(cfg), key=lambda t: t.param)  # stable: each parameter's slices together
    shards, size = [[]], 0
    for t in plan:
        nbytes = math.prod(t.shape) * np_dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    by_name = {t.hf_name: t for t in plan}

    def produce(name: str) -> np.ndarray:
        t = by_name[name]
        return t.hf_value(source.get).astype(np_dtype)

    names = [st.SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with staged_directory(out_dir) as staging:
        for name, shard in zip(names, shards, strict=True):
            st.write(os.path.join(staging, name), [(t.hf_name, t.shape, np_dtype) for t in shard], produce,
                     {"format": "pt"})
        if len(shards) > 1:
            total = sum(math.prod(t.shape) for t in plan) * np_dtype.itemsize
            index = {"metadata": {"total_size": total},
                     "weight_map": {t.hf_name: n for n, shard in zip(names, shards, strict=True) for t in shard}}
            with open(os.path.join(staging, st.INDEX), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        # a run's tokenizer is its token store's (a run on synthetic tokens has none, whatever data.path says)
        trained_on = first_manifest(run_cfg.data.path) if run_cfg.data.source == "store" else {}
        wrote = hf_tokenizer.export(ckpt_dir, None if step_dir is None else trained_on, cfg.max_seq_len, staging)
    log.info("tokenizer: %s", wrote)
    return hf


def main(argv: list[str]) -> int:
    """`jaxtron convert from-hf|to-hf`: converts as the command line ``argv`` says."""
    from jaxtron.common.console import console_logging

    console_logging()
    parser = argparse.ArgumentParser(prog="jaxtron convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory -> jaxtron parameters and config.py")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    b = sub.add_parser("to-hf", help="jaxtron converted model or training run -> Hugging Face directory")
    b.add_argument("ckpt_dir")
    b.add_argument("out_dir")
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written tensors (default float32, the training precision)")
    args = parser.parse_args(argv)
    args.out_dir = user_path(args.out_dir)
    if args.command == "from-hf":
        args.hf_dir = user_path(args.hf_dir)
        cfg = from_hf(args.hf_dir, args.out_dir)
        log.info("wrote %s/params and %s/config.py (%s, %d layers%s)", args.out_dir, args.out_dir, cfg.name,
                 cfg.num_layers, f", {cfg.moe.num_experts} experts" if cfg.moe.num_experts else "")
    else:
        to_hf(user_path(args.ckpt_dir), args.out_dir, args.dtype)
        log.info("wrote %s/config.json and safetensors", args.out_dir)
    return 0

