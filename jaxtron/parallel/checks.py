"""What a config needs of its devices: each size the rules table splits must divide into its pieces.

How many pieces a dimension is cut into is the rules table's answer (``shard_count``), never an axis product written
here: the data-parallel size is how many ways ``activation_batch`` splits, the tensor size how many ways ``heads``
splits, and so on. The messages name the mesh axes the table uses, so a user knows which ``mesh.*`` field to change.
"""

from __future__ import annotations

import math

from jaxtron.config.checks import _check
from jaxtron.config.recipes import RECIPE_BLOCKS, block_scaled_widths
from jaxtron.config.schema import ONE_F_ONE_B, Config
from jaxtron.parallel.sharding import logical_to_spec, shard_count, spec_axes


def mesh_axes(logical: str, join: str = " x ", sizes: dict[str, int] | None = None) -> str:
    """The mesh fields that split a logical axis, as a user writes them: 'mesh.tensor', 'mesh.sequence x
    mesh.tensor'; ``join='*'`` gives a product of axis names, 'data*fsdp*expert'. With ``sizes``, only those of
    more than one device (the first of them where none has more)."""
    axes = spec_axes(logical_to_spec((logical,)), 0)
    if sizes is not None:
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1) or axes[:1]
    return "*".join(axes) if join == "*" else join.join(f"mesh.{a}" for a in axes)


def check_devices(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks everything about ``cfg`` that depends on the device count; returns the resolved mesh sizes."""
    sizes = cfg.mesh.resolve(num_devices)
    m, t = cfg.model, cfg.train
    widths = [("attention.num_heads", m.attention.num_heads, "heads"),
              ("attention.num_kv_heads", m.attention.num_kv_heads, "kv_heads"),
              ("mlp_dim", m.mlp_dim, "mlp"), ("vocab_size", m.vocab_size, "vocab"), ("embed_dim", m.embed_dim, "embed")]
    if m.latent_attention:
        widths += [("attention.kv_lora_rank", m.attention.kv_lora_rank, "latent")]
        widths += [("attention.q_lora_rank", m.attention.q_lora_rank, "latent")] if m.attention.q_lora_rank else []
    if m.moe.num_experts:
        widths += [("moe.expert_dim", m.resolved_expert_dim, "mlp"), ("moe.num_experts", m.moe.num_experts, "experts")]
    for field, value, logical in widths:
        ways = shard_count(sizes, logical)
        axes = mesh_axes(logical, sizes=sizes)
        _check(value % ways == 0, f"model.{field}", f"({value}) is not divisible by {axes} ({ways})",
               f"choose a {axes} that divides {value}")
    nodes = cfg.execution.moe_node_shards
    if m.moe.num_experts and nodes:
        ways = shard_count(sizes, "experts")
        _check(ways % nodes == 0, "execution.moe_node_shards", f"({nodes}) does not divide the {ways} expert shards "
               f"of {mesh_axes('experts')}", f"give the expert shards of one node, a divisor of {ways}")
    dp = shard_count(sizes, "activation_batch")
    micro = t.global_batch_size // t.microbatches
    _check(micro % dp == 0, "train.global_batch_size",
           f"({t.global_batch_size}, {micro} per microbatch) is not divisible by the data-parallel size "
           f"{mesh_axes('activation_batch', '*')} = {dp}", f"use a multiple of {dp * t.microbatches}")
    _check_pipeline(cfg, shard_count(sizes, "layers"), micro, dp)
    sp, n = shard_count(sizes, "activation_length"), cfg.data.seq_len
    _check(sp == 1 or not m.mtp.depth, "model.mtp.depth", f"({m.mtp.depth}) shifts each row by whole tokens, "
           f"which the load-balanced layout of mesh.sequence={sp} does not keep in order",
           "set it to 0 or use mesh.sequence=1")
    # the load-balanced layout gives each sequence shard two chunks of a row; between blocks the residual stream is
    # split further (over the tensor group: activation_residual_length)
    _check(sp == 1 or cfg.execution.attention != "cudnn" or not (m.attention.local or m.attention.sinks),
           "execution.attention", f"is 'cudnn' on a sequence split {sp} ways, which runs cuDNN by chunks without "
           "windows, attention chunks or sinks", "use 'auto', which runs the blockwise kernel there")
    chunks = 2 * sp if sp > 1 else 1
    _check(n % chunks == 0, "data.seq_len", f"({n}) is not divisible by 2 x mesh.sequence ({chunks}), the "
           "chunks of the load-balanced layout", f"use a multiple of {chunks}")
    residual = shard_count(sizes, "activation_residual_length")
    _check(n % residual == 0, "data.seq_len", f"({n}) is not divisible by {mesh_axes('activation_residual_length')} "
           f"({residual}), over which the residual stream is split", f"use a multiple of {math.lcm(chunks, residual)}")
    _check_blocks(cfg, sizes, chunks)
    return sizes


def _check_blocks(cfg: Config, sizes: dict[str, int], chunks: int) -> None:
    """A block-scaled recipe's blocks lie within each device's share of every contracted dimension (a block across
    two devices would be quantized otherwise than on one: ``ops/block_scaled.py``). A row's tokens on a split
    sequence come in ``chunks`` pieces (the load-balanced layout), each of whole blocks."""
    x = cfg.execution
    block = RECIPE_BLOCKS.get(x.fp8_recipe) if x.fp8 else None
    for field, size, logical in block_scaled_widths(cfg.model, cfg.data.seq_len) if block else ():
        if logical is None:
            continue
        ways = chunks if logical == "activation_length" else shard_count(sizes, logical)
        _check(size % (ways * block) == 0, "execution.fp8_recipe",
               f"is '{x.fp8_recipe}', whose {block}-element blocks would straddle devices: {field} ({size}) splits "
               f"into {ways} pieces of {size // ways} over {mesh_axes(logical, sizes=sizes)}",
               "choose a split that leaves each device whole blocks, or another recipe")


def _check_pipeline(cfg: Config, stages: int, batch: int, dp: int) -> None:
    """The schedule's sizes: the scanned periods of blocks split into stages x virtual stages, at least one
    microbatch per stage, each microbatch divisible by the data-parallel size."""
    m, x = cfg.model, cfg.execution
    microbatches, virtual = cfg.pipeline.sizes(stages)
    period, periods, prefix = m.period, m.stack_periods, m.prefix_layers
    unit = f"periods of model.moe.every={period} blocks" if period > 1 else "layers"
    unit += f" after the {prefix} dense ones" if prefix else ""
    split = stages * virtual
    _check(periods % split == 0 or cfg.pipeline.uneven_stages, "model.num_layers",
           f"({m.num_layers}: {periods} {unit}) cannot be split into mesh.pipeline={stages} stages x "
           f"pipeline.virtual_stages={virtual}", "choose stage and virtual stage counts whose product divides "
           "it, or set --config.pipeline.uneven_stages=True to fill the last stages up with identity layers")
    pads = -periods % split
    _check(-(-pads // stages) < (periods + pads) // stages, "model.num_layers",  # (spread over the stages)
           f"({m.num_layers}: {periods} {unit}) would leave a stage of mesh.pipeline={stages} x "
           f"pipeline.virtual_stages={virtual} with only identity layers", "use fewer stages or virtual stages")
    if stages == 1 and microbatches == 1:
        return
    name = cfg.pipeline.schedule
    if name in ONE_F_ONE_B:
        _check(cfg.train.microbatches == 1, "train.microbatches",
               f"({cfg.train.microbatches}) would flush the '{name}' schedule once per part; it runs all of a step's "
               "microbatches in one schedule", f"set pipeline.microbatches to {microbatches * cfg.train.microbatches}"
               " and train.microbatches to 1")
    if name == "interleaved":
        _check(microbatches % stages == 0, "pipeline.microbatches",
               f"({microbatches}) does not split into waves of one microbatch per stage of mesh.pipeline={stages}, "
               "which the 'interleaved' schedule runs through each virtual stage in turn",
               f"use a multiple of {stages}")
    _check(microbatches >= stages, "pipeline.microbatches",
           f"({microbatches}) cannot keep mesh.pipeline={stages} stages busy",
           f"set --config.pipeline.microbatches to at least {stages}")
    _check(batch % (microbatches * dp) == 0, "pipeline.microbatches",
           f"({microbatches}) times the data-parallel size {dp} does not divide the {batch} rows of a batch"
           + (" (train.global_batch_size / train.microbatches)" if cfg.train.microbatches > 1 else ""),
           f"choose a global batch size that is a multiple of {microbatches * dp * cfg.train.microbatches}")
    _check(not (x.fp8 and x.fp8_skip_layers), "execution.fp8_skip_layers",
           f"({x.fp8_skip_layers}) keeps some blocks in 16 bits, which a pipelined stack cannot mix with FP8 "
           "ones", "set it to 0 or use mesh.pipeline=1 and pipeline.microbatches=1")
