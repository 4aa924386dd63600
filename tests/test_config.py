"""Bad input -> one ConfigError sentence naming the field and the fix; the CLI prints it and exits 2.

Also checks that valid input of every kind lands, typed, in the frozen dataclasses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from conftest import cpu_xla_flags

from jaxtron.config.loader import load_config, parse_command_line
from jaxtron.config.schema import (
    SECTIONS,
    Config,
    ConfigError,
    DataConfig,
    ExecutionConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from jaxtron.ops.attention import resolve_implementation
from jaxtron.parallel.checks import check_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "configs", "default.py")


def cli(*argv: str) -> Config:
    """Parses arguments the way train.py does (default config file unless --config is given)."""
    return parse_command_line(["train.py", *argv], DEFAULT)[0]


def config_file(directory, body: str, name: str = "user_config.py") -> str:
    path = os.path.join(str(directory), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


def file_setting_path(directory, *lines: str) -> str:
    """A config file whose get_config() runs ``lines`` on top of an empty ConfigDict ``c``."""
    body = "import ml_collections\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
    body += "".join(f"    {line}\n" for line in lines) + "    return c\n"
    return config_file(directory, body)


def file_setting(directory, *lines: str) -> Config:
    return load_config(file_setting_path(directory, *lines))


def assert_one_sentence(message: str) -> None:
    assert message, "empty error message"
    assert "\n" not in message, f"message spans lines: {message!r}"
    assert message.endswith("."), f"message does not end with a period: {message!r}"
    assert not re.search(r"[.!?]\s+[A-Z]", message), f"two sentences: {message!r}"
    assert "Traceback" not in message


def mesh(**sizes) -> MeshConfig:
    return MeshConfig(**{"fsdp": -1, **sizes})


# (id, call that must raise given a temp dir, text naming the field, text of the fix)
BAD = [
    # --- command-line overrides: names and types
    ("unknown_field", lambda d: cli("--config.train.stepz=5"),
     "'train.stepz'", "use 'train.steps' (closest match) or another field of 'train'"),
    ("unknown_field_no_close_match", lambda d: cli("--config.model.qqqqqq=5"),
     "'model.qqqqqq'", "use one of the fields of 'model': activation, embed_dim"),
    ("unknown_section", lambda d: cli("--config.trian.steps=5"),
     "'trian'", "use one of model, execution, mesh, pipeline, train, optimizer, data"),
    ("whole_section", lambda d: cli("--config.train=5"),
     "'train'", "set one of its fields with --config.train.<field>=VALUE"),
    ("override_without_value", lambda d: cli("--config.train.steps"),
     "'--config.train.steps'", "write --config.train.steps=VALUE"),
    ("int_from_word", lambda d: cli("--config.train.steps=abc"),
     "'train.steps' expects int but got 'abc'", "pass a valid int to --config.train.steps"),
    ("int_from_float", lambda d: cli("--config.train.steps=1.5"),
     "'train.steps' expects int but got '1.5'", "pass a valid int to --config.train.steps"),
    ("float_from_word", lambda d: cli("--config.optimizer.learning_rate=fast"),
     "'optimizer.learning_rate' expects float", "pass a valid float to --config.optimizer.learning_rate"),
    ("bool_maybe", lambda d: cli("--config.model.tie_embeddings=maybe"),
     "'model.tie_embeddings' expects bool but got 'maybe'", "pass true or false to --config.model.tie_embeddings"),
    # --- config files
    ("file_str_for_int", lambda d: file_setting(d, "c.train = dict(steps='10')"),
     "'train.steps' must be int but is str ('10')", "fix it in the config file or with --config.train.steps"),
    ("file_bool_for_int", lambda d: file_setting(d, "c.train = dict(steps=True)"),
     "'train.steps' must be int but is bool", "fix it in the config file or with --config.train.steps"),
    ("file_str_for_float", lambda d: file_setting(d, "c.optimizer = dict(learning_rate='3e-4')"),
     "'optimizer.learning_rate' must be float but is str", "--config.optimizer.learning_rate"),
    ("file_unknown_field", lambda d: file_setting(d, "c.model = dict(widthh=5)"),
     "'model.widthh'", "use one of the fields of 'model'"),
    ("file_unknown_section", lambda d: file_setting(d, "c.trainer = dict(steps=5)"),
     "'trainer'", "use one of model, execution, mesh, pipeline, train, optimizer, data"),
    ("file_section_not_group", lambda d: file_setting(d, "c.train = 5"),
     "'train' must hold fields, not 5", "make it a dict of fields in the config file"),
    ("file_section_not_group_overridden",
     lambda d: load_config(file_setting_path(d, "c.train = 5"), [("train.steps", "3")]),
     "'train' must hold fields, not 5", "make it a dict of fields in the config file"),
    ("missing_file", lambda d: load_config(os.path.join(str(d), "nope.py")),
     "nope.py' does not exist", "pass a file (--config=path/to/X.py) or a shipped config's name (deepseek_tiny, "),
    ("unknown_shipped_name", lambda d: load_config("llama3_9b"),
     "config file 'llama3_9b' does not exist", "or a shipped config's name (deepseek_tiny, deepseek_v3, default,"),
    ("file_without_get_config", lambda d: load_config(config_file(d, "X = 1\n")),
     "user_config.py' defines no get_config()", "add one returning a ConfigDict"),
    ("file_raises_on_import", lambda d: load_config(config_file(d, "raise RuntimeError('broken import')\n")),
     "user_config.py' failed to load (RuntimeError: broken import)", "fix the file"),
    ("get_config_raises", lambda d: load_config(config_file(d, """\
         def get_config():
             raise ValueError("bad value\\non two lines.")
         """)),
     "user_config.py' get_config() raised ValueError: bad value on two lines", "fix the file"),
    ("get_config_bug_type_error", lambda d: load_config(config_file(d, "def get_config():\n    return len(3)\n")),
     "get_config() raised TypeError", "fix the file"),
    ("get_config_rejects_arg", lambda d: load_config(config_file(d, "def get_config():\n    return {}\n") + ":big"),
     "get_config() rejected the argument 'big'", "check the ':ARG' part of --config"),
    ("unknown_qwen3_size", lambda d: load_config(os.path.join(REPO, "configs", "qwen3.py") + ":9b"),
     "get_config() rejected the argument '9b' (ValueError: unknown Qwen3 size '9b', not one of 0.6b, 8b",
     "check the ':ARG' part of --config"),
    ("get_config_returns_none", lambda d: load_config(config_file(d, "def get_config():\n    return None\n")),
     "get_config() returned NoneType", "return a ConfigDict"),
    # --- values of single fields
    ("zero_steps", lambda d: cli("--config.train.steps=0"),
     "'train.steps' must be positive (got 0)", "set --config.train.steps to a value > 0"),
    ("microbatches_not_dividing", lambda d: cli("--config.train.microbatches=3"),
     "'train.microbatches' (3) must divide train.global_batch_size (16)", "choose a divisor of the global batch size"),
    ("zero_learning_rate", lambda d: cli("--config.optimizer.learning_rate=0"),
     "'optimizer.learning_rate' must be positive", "set --config.optimizer.learning_rate to a value > 0"),
    ("negative_learning_rate", lambda d: cli("--config.optimizer.learning_rate=-1e-3"),
     "'optimizer.learning_rate' must be positive (got -0.001)", "to a value > 0"),
    ("negative_warmup", lambda d: cli("--config.optimizer.warmup_steps=-5"),
     "'optimizer.warmup_steps' must be >= 0 (got -5)", "set --config.optimizer.warmup_steps to a value >= 0"),
    ("b2_one", lambda d: cli("--config.optimizer.b2=1.0"),
     "'optimizer.b2' must lie in [0, 1) (got 1.0)", "set --config.optimizer.b2 inside that range"),
    ("min_lr_ratio_above_one", lambda d: cli("--config.optimizer.min_lr_ratio=1.5"),
     "'optimizer.min_lr_ratio' must lie in [0, 1] (got 1.5)", "set --config.optimizer.min_lr_ratio inside"),
    ("moved_field", lambda d: cli("--config.model.remat=full"),
     "'model.remat' is now 'execution.remat'", "set --config.execution.remat instead"),
    ("unknown_remat", lambda d: cli("--config.execution.remat=everything"),
     "'execution.remat' is 'everything', which is not one of 'none', 'full', 'save_dots'",
     "set --config.execution.remat to one of those"),
    ("unknown_dtype", lambda d: cli("--config.execution.dtype=bf16"),
     "'execution.dtype' is 'bf16'", "set --config.execution.dtype to one of those"),
    ("unknown_attention", lambda d: cli("--config.execution.attention=flash"),
     "'execution.attention' is 'flash', which is not one of 'auto', 'xla', 'cudnn'",
     "set --config.execution.attention to one of those"),
    ("unknown_data_source", lambda d: cli("--config.data.source=web"),
     "'data.source' is 'web'", "set --config.data.source to one of those"),
    ("kv_heads_not_dividing_heads", lambda d: cli("--config.model.attention.num_kv_heads=4"),
     "'model.attention.num_kv_heads' (4) must divide model.attention.num_heads (6)",
     "choose a divisor of model.attention.num_heads"),
    ("head_dim_underivable", lambda d: ModelConfig(embed_dim=100, attention=dict(num_heads=6, num_kv_heads=2)),
     "'model.attention.head_dim' is 0 (derived) but model.embed_dim (100)", "set model.attention.head_dim explicitly"),
    ("seq_len_over_max", lambda d: cli("--config.data.seq_len=2048"),
     "'data.seq_len' (2048) exceeds model.max_seq_len (1024)", "shorten the sequence or raise model.max_seq_len"),
    ("vocab_too_small_for_bytes", lambda d: cli("--config.model.vocab_size=100"),
     "'model.vocab_size' (100) is too small", "use at least 256"),
    ("rope_factors_inverted", lambda d: ModelConfig(rope=dict(low_freq_factor=4.0, high_freq_factor=2.0)),
     "'model.rope.high_freq_factor' (2.0) must not be below model.rope.low_freq_factor (4.0)", "raise it or lower"),
    # --- the mesh and everything that depends on the device count
    ("mesh_zero_axis", lambda d: MeshConfig(data=0),
     "'mesh.data' is 0", "use a positive size or -1"),
    ("mesh_two_rest_axes", lambda d: MeshConfig(fsdp=-1, tensor=-1),
     "'mesh.tensor' is -1 but so is mesh.fsdp", "give a positive size to all but one of them"),
    ("mesh_rest_not_dividing", lambda d: mesh(tensor=3).resolve(8),
     "'mesh.fsdp' is -1 but the other axes multiply to 3", "choose axis sizes whose product divides the device count"),
    ("mesh_product_not_device_count", lambda d: check_devices(Config(mesh=MeshConfig(fsdp=3)), 8),
     "'mesh.*' (pipeline=1, data=1, fsdp=3, sequence=1, expert=1, tensor=1) multiply to 3 but there are 8 devices",
     "make pipeline*data*fsdp*sequence*expert*tensor equal the device count or set one axis to -1"),
    ("heads_not_divisible_by_tensor",
     lambda d: check_devices(Config(model=ModelConfig(embed_dim=192, attention=dict(num_heads=6, num_kv_heads=2)),
                                    mesh=mesh(tensor=4)), 8),
     "'model.attention.num_heads' (6) is not divisible by mesh.tensor (4)", "choose a mesh.tensor that divides 6"),
    ("kv_heads_not_divisible_by_tensor",
     lambda d: check_devices(Config(model=ModelConfig(attention=dict(num_heads=8, num_kv_heads=2)),
                                    mesh=mesh(tensor=4)), 8),
     "'model.attention.num_kv_heads' (2) is not divisible by mesh.tensor (4)", "choose a mesh.tensor that divides 2"),
    ("embed_not_divisible_by_fsdp",
     lambda d: check_devices(Config(model=ModelConfig(embed_dim=100, attention=dict(num_heads=4, num_kv_heads=2))), 8),
     "'model.embed_dim' (100) is not divisible by mesh.fsdp (8)", "choose a mesh.fsdp that divides 100"),
    ("embed_not_divisible_by_fsdp_and_expert",  # the weights outside the experts split over both
     lambda d: check_devices(Config(model=ModelConfig(embed_dim=96, attention=dict(num_heads=4, num_kv_heads=2)),
                                    mesh=mesh(fsdp=2, expert=-1)), 128),
     "'model.embed_dim' (96) is not divisible by mesh.fsdp x mesh.expert (128)",
     "choose a mesh.fsdp x mesh.expert that divides 96"),
    ("latent_rank_not_divisible_by_fsdp",  # latent attention's up-projections split their latent like embed
     lambda d: check_devices(Config(model=ModelConfig(attention=dict(num_heads=4, num_kv_heads=4, kv_lora_rank=12,
                                                                     qk_rope_head_dim=8))), 8),
     "'model.attention.kv_lora_rank' (12) is not divisible by mesh.fsdp (8)", "choose a mesh.fsdp that divides 12"),
    ("query_latent_rank_not_divisible_by_fsdp_and_expert",
     lambda d: check_devices(Config(model=ModelConfig(attention=dict(num_heads=4, num_kv_heads=4, kv_lora_rank=16,
                                                                     q_lora_rank=24, qk_rope_head_dim=8)),
                                    mesh=mesh(fsdp=2, expert=-1)), 16),
     "'model.attention.q_lora_rank' (24) is not divisible by mesh.fsdp x mesh.expert (16)",
     "choose a mesh.fsdp x mesh.expert that divides 24"),
    ("batch_not_divisible_by_data_parallel",
     lambda d: check_devices(Config(train=TrainConfig(global_batch_size=12)), 8),
     ("'train.global_batch_size' (12, 12 per microbatch) is not divisible by the data-parallel size "
     "data*fsdp*expert = 8"), "use a multiple of 8"),
    ("batch_with_microbatches_not_divisible",
     lambda d: check_devices(Config(train=TrainConfig(global_batch_size=24, microbatches=2),
                      mesh=mesh(data=2, expert=2)), 8),
     ("'train.global_batch_size' (24, 12 per microbatch) is not divisible by the data-parallel size "
     "data*fsdp*expert = 8"), "use a multiple of 16"),
    ("seq_len_not_divisible_by_sequence",
     lambda d: check_devices(Config(data=DataConfig(seq_len=250), mesh=mesh(sequence=4)), 8),
     "'data.seq_len' (250) is not divisible by 2 x mesh.sequence (8), the chunks of the load-balanced layout",
     "use a multiple of 8"),
    ("seq_len_not_divisible_by_sequence_and_tensor",
     lambda d: check_devices(Config(data=DataConfig(seq_len=20), mesh=mesh(sequence=2, tensor=4)), 8),
     ("'data.seq_len' (20) is not divisible by mesh.sequence x mesh.tensor (8), over which the residual stream is "
     "split"), "use a multiple of 8"),
    ("cudnn_on_cpu", lambda d: resolve_implementation("cudnn", jnp.bfloat16, backend="cpu"),
     "'execution.attention' is 'cudnn' but the backend is cpu", "use 'auto' or 'xla'"),
    ("cudnn_in_float32", lambda d: resolve_implementation("cudnn", jnp.float32, backend="gpu"),
     "'execution.attention' is 'cudnn' but compute dtype float32 is not 16-bit", "use 'auto' or 'xla'"),
    ("cudnn_with_odd_head_dim", lambda d: resolve_implementation("cudnn", jnp.bfloat16, 100, 1, backend="gpu"),
     "'execution.attention' is 'cudnn' but head_dim 100 is not a multiple of 8 up to 128", "use 'auto' or 'xla'"),
    ("cudnn_with_head_dim_over_256_on_hopper",
     lambda d: resolve_implementation("cudnn", jnp.bfloat16, 264, 1, backend="gpu", capability=(9, 0)),
     "'execution.attention' is 'cudnn' but head_dim 264 is not a multiple of 8 up to 256, as cuDNN needs on this GPU",
     "use 'auto' or 'xla'"),
    ("float16_compute", lambda d: ExecutionConfig(dtype="float16"), "'execution.dtype'",
     "set --config.execution.dtype"),
    # --- DeepSeek-V3's parts: latent attention, the sigmoid router and its groups, the balancing bias
    ("latent_attention_with_fewer_kv_heads",
     lambda d: ModelConfig(attention=dict(num_heads=8, num_kv_heads=4, kv_lora_rank=16)),
     "'model.attention.num_kv_heads' (4) must equal model.attention.num_heads (8) with latent attention",
     "set model.attention.num_kv_heads=8"),
    ("groups_with_softmax_router", lambda d: ModelConfig(moe=dict(num_experts=8, router_groups=4)),
     "'model.moe.router_groups' (4) needs model.moe.router='sigmoid'", "set model.moe.router='sigmoid'"),
    ("groups_not_dividing_experts", lambda d: ModelConfig(moe=dict(num_experts=8, router="sigmoid", router_groups=3)),
     "'model.moe.router_groups' (3) must divide model.moe.num_experts (8)", "choose a divisor of it"),
    ("top_k_beyond_the_groups", lambda d: ModelConfig(moe=dict(num_experts=16, experts_per_token=6, router="sigmoid",
                                                               router_groups=4, router_top_groups=1)),
     "'model.moe.experts_per_token' (6) exceeds the 4 experts", "raise model.moe.router_top_groups"),
    ("dense_prefix_with_moe_every", lambda d: ModelConfig(moe=dict(num_experts=4, every=2, first_dense_layers=1),
                                                          num_layers=4),
     "'model.moe.first_dense_layers' (1) needs model.moe.every=1", "set model.moe.every=1"),
    ("unknown_rope_scaling", lambda d: cli("--config.model.rope.scaling=ntk"),
     "'model.rope.scaling' is 'ntk', which is not one of 'llama3', 'yarn'", "set --config.model.rope.scaling"),
    ("bias_rate_with_softmax_router", lambda d: cli("--config.model.moe.num_experts=4",
                                                    "--config.train.router_bias_rate=0.001"),
     "'train.router_bias_rate' (0.001) moves the sigmoid router's balancing bias", "model.moe.router='sigmoid'"),
    ("bias_rate_without_experts", lambda d: cli("--config.model.moe.router=sigmoid",
                                                "--config.train.router_bias_rate=0.001"),
     "'train.router_bias_rate' (0.001) moves the routed experts' balancing bias, but the model has no MoE blocks",
     "set it to 0"),
    # --- pipeline schedules
    ("unknown_schedule", lambda d: cli("--config.pipeline.schedule=gpipe"),
     "'pipeline.schedule' is 'gpipe', which is not one of 'fill_drain', '1f1b', 'interleaved'",
     "set --config.pipeline.schedule"),
    ("virtual_stages_without_rounds", lambda d: cli("--config.pipeline.schedule=1f1b",
                                                    "--config.pipeline.virtual_stages=2"),
     "'pipeline.virtual_stages' (2) splits each stage into rounds, which the '1f1b' schedule does not run",
     "use pipeline.schedule='interleaved' (1F1B over virtual stages)"),
    ("interleaved_without_virtual_stages", lambda d: cli("--config.pipeline.schedule=interleaved"),
     "'pipeline.virtual_stages' (1) leaves the 'interleaved' schedule one chunk of layers a stage",
     "set it to 2 or more"),
    ("interleaved_microbatches_not_in_groups_of_stages", lambda d: check_devices(cli(
        "--config.pipeline.schedule=interleaved", "--config.pipeline.virtual_stages=2", "--config.mesh.pipeline=2",
        "--config.mesh.fsdp=4", "--config.pipeline.microbatches=3", "--config.train.global_batch_size=24",
        "--config.model.num_layers=4"), 8),
     "'pipeline.microbatches' (3) does not split into waves of one microbatch per stage of mesh.pipeline=2",
     "use a multiple of 2"),
    ("interleaved_with_too_few_microbatches", lambda d: check_devices(cli(
        "--config.pipeline.schedule=interleaved", "--config.pipeline.virtual_stages=2", "--config.mesh.pipeline=4",
        "--config.mesh.fsdp=2", "--config.pipeline.microbatches=2", "--config.model.num_layers=8"), 8),
     "'pipeline.microbatches' (2) does not split into waves of one microbatch per stage of mesh.pipeline=4",
     "use a multiple of 4"),
    ("1f1b_under_accumulation", lambda d: check_devices(cli(
        "--config.pipeline.schedule=1f1b", "--config.mesh.pipeline=2", "--config.mesh.fsdp=4",
        "--config.train.microbatches=2", "--config.train.global_batch_size=32"), 8),
     "'train.microbatches' (2) would flush the '1f1b' schedule once per part",
     "set pipeline.microbatches to 4 and train.microbatches to 1"),
    ("1f1b_with_too_few_microbatches", lambda d: check_devices(cli(
        "--config.pipeline.schedule=1f1b", "--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
        "--config.pipeline.microbatches=2"), 8),
     "'pipeline.microbatches' (2) cannot keep mesh.pipeline=4 stages busy", "at least 4"),
    ("gather_once_under_fill_drain", lambda d: cli("--config.pipeline.fsdp_gather=step"),
     "'pipeline.fsdp_gather' 'step' holds a stage's weights whole through the '1f1b' and 'interleaved' schedules",
     "use pipeline.schedule='1f1b' with it"),
    ("unknown_fsdp_gather", lambda d: cli("--config.pipeline.fsdp_gather=layer"),
     "'pipeline.fsdp_gather' is 'layer', which is not one of 'iteration', 'step'", "set --config.pipeline.fsdp_gather"),
    ("mtp_on_a_sharded_sequence", lambda d: check_devices(cli("--config.model.mtp.depth=1", "--config.mesh.sequence=2",
                                                 "--config.mesh.fsdp=1"), 2),
     "'model.mtp.depth' (1) shifts each row by whole tokens", "use mesh.sequence=1"),
    ("decay_not_after_warmup", lambda d: OptimizerConfig(warmup_steps=100, decay_steps=50),
     "'optimizer.decay_steps' (50) must exceed optimizer.warmup_steps (100)", "raise it or set it to 0"),
]


@pytest.mark.parametrize("call, field, fix", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_one_sentence_naming_field_and_fix(tmp_path, call, field, fix):
    with pytest.raises(ConfigError) as info:
        call(tmp_path)
    message = str(info.value)
    assert field in message, f"{field!r} not named in {message!r}"
    assert fix in message, f"fix {fix!r} missing from {message!r}"
    assert_one_sentence(message)
    problem, _, remedy = message.partition("; ")  # shape: "<what is wrong>; <what to do>."
    assert field in problem and fix in remedy, f"not '<problem naming {field}>; <fix>.': {message!r}"


def test_bad_config_error_has_no_chained_traceback(tmp_path):
    """Errors from a user's file are re-raised 'from None', so nothing else is printed with them."""
    with pytest.raises(ConfigError) as info:
        load_config(config_file(tmp_path, "def get_config():\n    raise KeyError('x')\n"))
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ------------------------------------------------------------------------------------------- valid input


def test_overrides_of_each_type_land_typed_in_the_frozen_config():
    cfg = cli("--config.train.steps=7", "--config.optimizer.learning_rate=1e-3", "--config.optimizer.b1=0.8",
              "--config.model.rope.theta=2", "--config.model.tie_embeddings=false", "--config.data.source=synthetic",
              "--config.execution.remat", "save_dots")  # the '--flag value' form too
    assert cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.optimizer.learning_rate == 1e-3 and type(cfg.optimizer.learning_rate) is float
    assert cfg.optimizer.b1 == 0.8
    assert cfg.model.rope.theta == 2.0 and type(cfg.model.rope.theta) is float  # '2' for a float field
    assert cfg.model.tie_embeddings is False  # the default config file sets it True
    assert cfg.data.source == "synthetic" and cfg.execution.remat == "save_dots"
    # untouched values keep what the config file set
    base = cli()
    assert (cfg.model.embed_dim, cfg.train.global_batch_size, cfg.optimizer.warmup_steps) == \
        (base.model.embed_dim, base.train.global_batch_size, base.optimizer.warmup_steps)
    assert base.model.tie_embeddings is True and base.train.steps != 7


def test_later_override_wins_and_true_parses():
    cfg = cli("--config.model.tie_embeddings=false", "--config.model.tie_embeddings=true")
    assert cfg.model.tie_embeddings is True


@pytest.mark.parametrize("text, expected", [("true", True), ("True", True), ("1", True), ("t", True),
                                            ("false", False), ("FALSE", False), ("0", False), ("f", False)])
def test_bool_spellings(text, expected):
    assert cli(f"--config.model.tie_embeddings={text}").model.tie_embeddings is expected


def test_a_config_file_of_the_older_layout_loads_with_its_fields_moved(tmp_path, caplog):
    path = file_setting_path(tmp_path, "c.model = dict(dtype='bfloat16', remat='full', router_aux_loss=0.05)",
                             "c.execution = dict(remat='save_dots')")
    with caplog.at_level("WARNING"):
        cfg = cli(f"--config={path}", "--config.execution.fp8=true")
    assert (cfg.execution.dtype, cfg.execution.remat, cfg.execution.fp8) == ("bfloat16", "save_dots", True)
    assert cfg.train.router_aux_loss == 0.05  # and the value set at the new place wins
    assert "config field 'model.dtype' is now 'execution.dtype'" in caplog.text


def test_a_config_file_of_flat_model_fields_loads_into_the_groups_with_a_warning_each(tmp_path, caplog):
    flat = ("c.model = dict(num_layers=4, num_heads=4, num_kv_heads=2, qk_norm=True, rope_theta=1e6, "
            "rope_scaling_factor=8.0, num_experts=4, moe_every=2, router_renormalize=False, mtp_depth=1, "
            "attention='xla')")
    nested = (("c.model = dict(num_layers=4, attention=dict(num_heads=4, num_kv_heads=2, qk_norm=True), "
              "rope=dict(theta=1e6, factor=8.0), moe=dict(num_experts=4, every=2, router_renormalize=False), "
              "mtp=dict(depth=1))"), "c.execution = dict(attention='xla')")
    with caplog.at_level("WARNING"):
        old = cli(f"--config={file_setting_path(tmp_path, flat)}", "--config.model.moe.experts_per_token=1")
    moved = {line.split("'")[1]: line.split("'")[3] for line in caplog.text.splitlines() if "is now" in line}
    assert moved == {"model.num_heads": "model.attention.num_heads",
                     "model.num_kv_heads": "model.attention.num_kv_heads", "model.qk_norm": "model.attention.qk_norm",
                     "model.rope_theta": "model.rope.theta",
                     "model.rope_scaling_factor": "model.rope.factor", "model.num_experts": "model.moe.num_experts",
                     "model.moe_every": "model.moe.every", "model.router_renormalize": "model.moe.router_renormalize",
                     "model.mtp_depth": "model.mtp.depth", "model.attention": "execution.attention"}
    (tmp_path / "nested").mkdir()
    new = cli(f"--config={file_setting_path(tmp_path / 'nested', *nested)}", "--config.model.moe.experts_per_token=1")
    assert old == new and new.model.moe.experts_per_token == 1 and new.execution.attention == "xla"
    with pytest.raises(ConfigError, match=r"'model.num_experts' is now 'model.moe.num_experts'; set "
                                          r"--config.model.moe.num_experts instead"):
        cli("--config.model.num_experts=4")


OVERRIDES = [("model.rope.theta", "1e4", 1e4), ("execution.remat", "full", "full"), ("mesh.tensor", "2", 2),
             ("train.z_loss", "1e-4", 1e-4), ("optimizer.b2", "0.9", 0.9), ("data.seq_len", "64", 64),
             ("checkpoint.keep", "5", 5), ("distributed.heartbeat_timeout_s", "30", 30),
             ("profile.processes", "all", "all"), ("pipeline.virtual_stages", "2", 2), ("lora.rank", "8", 8),
             ("train.init_from", "/models/base", "/models/base"),
             ("lora.alpha", "32", 32.0), ("dpo.beta", "0.5", 0.5), ("rl.group_size", "4", 4)]


def test_a_field_the_file_does_not_set_can_be_overridden_in_every_section(tmp_path):
    """The file is laid over the schema's defaults before config_flags applies the overrides."""
    assert {path.split(".")[0] for path, _, _ in OVERRIDES} == set(SECTIONS)
    path = file_setting_path(tmp_path, "c.train = dict(steps=3)")
    cfg = cli(f"--config={path}", *(f"--config.{p}={text}" for p, text, _ in OVERRIDES))
    for p, _, expected in OVERRIDES:
        value = cfg
        for name in p.split("."):
            value = getattr(value, name)
        assert value == expected and type(value) is type(expected), p
    assert cfg.train.steps == 3


def test_explicit_config_file_and_sections_absent_from_it(tmp_path):
    path = file_setting_path(tmp_path, "c.train = dict(steps=3)")
    cfg = cli(f"--config={path}", "--config.mesh.tensor=2")  # 'mesh' is not in the file: defaults + override
    assert cfg.train.steps == 3 and cfg.mesh == MeshConfig(tensor=2)
    assert cfg.model == ModelConfig() and cfg.optimizer == OptimizerConfig()


def test_a_shipped_config_by_name_from_any_directory(tmp_path, monkeypatch):
    """``--config=llama3_8b`` is the shipped configs/llama3_8b.py wherever the command runs; a file of that name in
    the working directory is a path, and wins."""
    from jaxtron.config.loader import config_file, shipped_names
    monkeypatch.chdir(tmp_path)
    assert {"default", "llama3_8b", "qwen3", "sft"} <= set(shipped_names())
    for spec in ("llama3_8b", "llama3_8b.py", "configs/llama3_8b.py"):
        assert os.path.samefile(config_file(spec), os.path.join(REPO, "configs", "llama3_8b.py"))
    assert load_config("qwen3:8b").model.num_layers == load_config(os.path.join(REPO, "configs", "qwen3.py:8b")) \
        .model.num_layers
    (tmp_path / "llama3_8b.py").write_text("raise RuntimeError('mine')\n")
    assert config_file("llama3_8b.py") == "llama3_8b.py"
    with pytest.raises(ConfigError, match=r"'other/llama3_8b.py' does not exist"):
        config_file("other/llama3_8b.py")  # a folder that is not configs/ names a file, never a shipped config


def test_int_for_float_field_in_a_config_file_is_accepted(tmp_path):
    cfg = file_setting(tmp_path, "c.optimizer = dict(learning_rate=1, weight_decay=0)",
                       "c.model = dict(rope=dict(theta=10000))")
    assert cfg.optimizer.learning_rate == 1.0 and type(cfg.optimizer.learning_rate) is float
    assert type(cfg.optimizer.weight_decay) is float and type(cfg.model.rope.theta) is float


def test_mesh_rest_axis_resolves():
    assert MeshConfig(fsdp=-1).resolve(8) == dict(pipeline=1, data=1, fsdp=8, sequence=1, expert=1, tensor=1)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8)["fsdp"] == 2
    assert MeshConfig(fsdp=4, tensor=2).resolve(8) == dict(pipeline=1, data=1, fsdp=4, sequence=1, expert=1, tensor=2)
    sizes = check_devices(Config(mesh=MeshConfig(fsdp=-1, tensor=2)), 8)
    assert sizes == dict(pipeline=1, data=1, fsdp=4, sequence=1, expert=1, tensor=2)


def test_attention_choice_resolves():
    assert resolve_implementation("auto", jnp.bfloat16, backend="cpu") == "xla"
    assert resolve_implementation("auto", jnp.bfloat16, backend="gpu") == "cudnn"
    assert resolve_implementation("auto", jnp.float32, backend="gpu") == "xla"
    # DeepSeek-V3's heads (192 wide) run in cuDNN on Hopper, not on older GPUs
    assert resolve_implementation("auto", jnp.bfloat16, 192, backend="gpu", capability=(9, 0)) == "cudnn"
    assert resolve_implementation("auto", jnp.bfloat16, 192, backend="gpu", capability=(8, 0)) == "xla"
    # cuDNN cannot take a sharded sequence or an unusual head size: auto falls back to blockwise attention for
    # a sharded sequence (context parallelism) and to the XLA path otherwise
    assert resolve_implementation("auto", jnp.bfloat16, 128, 2, backend="gpu") == "blockwise"
    assert resolve_implementation("auto", jnp.float32, 128, 4, backend="cpu") == "blockwise"
    assert resolve_implementation("auto", jnp.bfloat16, 256, 1, backend="gpu") == "xla"
    assert resolve_implementation("auto", jnp.bfloat16, 64, 1, backend="gpu") == "cudnn"
    assert resolve_implementation("cudnn", jnp.bfloat16, backend="gpu") == "cudnn"
    # a sharded sequence: cuDNN by chunks when asked for, the blockwise kernel under 'auto'
    assert resolve_implementation("cudnn", jnp.bfloat16, 128, 2, backend="gpu") == "cudnn"
    assert resolve_implementation("xla", jnp.bfloat16, backend="cpu") == "xla"


# ------------------------------------------------------------------------------------------- train.py


def test_main_reports_errors_found_after_jax_starts(capsys, tmp_path):
    """cuDNN on the CPU is found in the loop (after the config is built); main prints it and returns 2."""
    import train

    code = train.main(["--config.execution.attention=cudnn", "--config.execution.dtype=bfloat16",
                       f"--workdir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: config field 'execution.attention' is 'cudnn' but the backend is cpu"), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_main_reports_bad_config_file(capsys, tmp_path):
    import train

    path = config_file(tmp_path, "def get_config():\n    raise ValueError('nope')\n")
    assert train.main([f"--config={path}", f"--workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: config file '{path}' get_config() raised ValueError: nope; fix the file.\n"


def run_train(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "train.py", *args, f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.integration
def test_cli_unknown_field_exits_2_without_traceback(tmp_path):
    proc = run_train(tmp_path, "--config.train.stepz=5")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: config field 'train.stepz' does not exist; use 'train.steps'"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.integration
def test_cli_mesh_mismatch_exits_2_without_traceback(tmp_path):
    proc = run_train(tmp_path, "--config.mesh.fsdp=3")
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error_lines == [("error: config fields 'mesh.*' (pipeline=1, data=1, fsdp=3, sequence=1, expert=1, "
                           "tensor=1) multiply to 3 but there are 8 devices; make pipeline*data*fsdp*sequence*expert*"
                           "tensor equal the device count or set one axis to -1.")], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "run")  # nothing was written


@pytest.mark.integration
def test_cli_print_sharding(tmp_path):
    proc = run_train(tmp_path, "--print_sharding", "--config.mesh.fsdp=4", "--config.mesh.tensor=2")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert "mesh: pipeline=1, data=1, fsdp=4, sequence=1, expert=1, tensor=2" in lines
    params = {line.split()[0]: line for line in lines if line.startswith(("layers.", "embedding", "final_norm"))}
    # the embedding width over fsdp and expert together (expert is 1 here)
    assert params["layers.attn.wq.weight"].endswith("P('pipeline', ('fsdp', 'expert'), 'tensor', None)"), \
        params["layers.attn.wq.weight"]
    assert "('layers', 'embed', 'heads', 'head_dim')" in params["layers.attn.wq.weight"]
    assert params["layers.attn.wo.weight"].endswith("P('pipeline', 'tensor', None, ('fsdp', 'expert'))")
    assert params["layers.mlp.wo.weight"].endswith("P('pipeline', 'tensor', ('fsdp', 'expert'))")
    assert params["embedding"].endswith("P('tensor', ('fsdp', 'expert'))")
    assert not os.path.exists(tmp_path / "run")  # printing the sharding trains nothing
