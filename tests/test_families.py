"""Model families as declared units (jaxtron/families/): each is found, its fixture is what it declares, its family
is read from ``model.family`` and never from flags, an export it cannot represent is refused in one sentence, and
what a family adds to the counts reaches them."""

import dataclasses
import json
import logging
import os

import pytest
from conftest import REPO

from jaxtron import cli, families
from jaxtron.config.checks import ConfigError
from jaxtron.config.loader import from_mapping, load_config
from jaxtron.config.model import ModelConfig
from jaxtron.config.schema import replace
from jaxtron.metrics import flops

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")
DECLARED = [(family, fixture) for family in families.all_families().values() for fixture in family.fixtures]


def test_every_family_module_declares_its_families_and_every_exported_one_has_a_fixture():
    found = families.all_families()
    assert set(found) == {"deepseek_v3", "gemma3", "gpt3", "gpt_oss", "llama", "mixtral", "qwen3", "qwen3_moe",
                          "qwen3_5", "qwen3_5_moe", "llama4"}
    for family in found.values():
        assert family.exported == bool(family.fixtures), family.name
    seeds = [fixture.seed for _, fixture in DECLARED]
    assert len(set(seeds)) == len(seeds)  # each fixture its own seed: writing one leaves the others as they are


def _as_written(fixture) -> dict:
    """What config.json should hold for a declared fixture: its config, in the 4.x form where it says so."""
    expected = json.loads(json.dumps(dict(fixture.config)))  # tuples as lists, as JSON has them
    if fixture.v4:
        rope = expected.pop("rope_parameters")
        expected["rope_theta"] = rope.pop("rope_theta")
        expected["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return expected


@pytest.mark.parametrize("family,fixture", DECLARED, ids=[fixture.name for _, fixture in DECLARED])
def test_each_fixture_on_disk_is_the_one_its_family_declares(family, fixture):
    with open(os.path.join(FIXTURES, fixture.name, "config.json")) as f:
        written = json.load(f)
    assert written["model_type"] == family.model_type and written["architectures"] == list(family.architectures[:1])
    for key, value in _as_written(fixture).items():
        if key == "num_local_experts" and key not in written:  # transformers 5 names Qwen3-MoE's experts so
            key = "num_experts"
        if key == "num_experts" and key not in written:
            key = "num_local_experts"
        assert written[key] == value, (fixture.name, key)
    assert families.of_config_json(written) is family
    sharded = os.path.exists(os.path.join(FIXTURES, fixture.name, "model.safetensors.index.json"))
    assert sharded == bool(fixture.shard)


def test_the_family_comes_from_the_field_and_an_export_it_cannot_represent_is_refused():
    llama = ModelConfig(name="x", family="llama", vocab_size=96, embed_dim=48, mlp_dim=80, num_layers=2,
                        attention=dict(num_heads=4, num_kv_heads=2))
    assert families.hf_config(llama)["architectures"] == ["LlamaForCausalLM"]
    # per-head norms under the llama family: refused, not exported as Qwen3 (export once told it from this flag)
    normed = replace(llama, attention=dict(qk_norm=True))
    with pytest.raises(families.FormatError, match=r"model.family='llama' has no Hugging Face form of "
                                                   r"model.attention.qk_norm"):
        families.hf_config(normed)
    assert families.hf_config(replace(normed, family="qwen3"))["architectures"] == ["Qwen3ForCausalLM"]
    # a family missing what it needs: Mixtral without experts
    with pytest.raises(families.FormatError, match=r"model.family='mixtral' needs model.moe.num_experts > 0"):
        families.hf_config(replace(llama, family="mixtral"))
    with pytest.raises(families.FormatError, match="model.family=.gpt3. has no Hugging Face class"):
        families.hf_config(replace(llama, family="gpt3"))


def test_an_unknown_family_is_one_sentence_naming_the_closest(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"'model.family' is 'qwen', which is no family; did you mean 'qwen3'\?"):
        families.get("qwen")
    code = cli.run("train", ["--config=configs/default.py", f"--workdir={tmp_path / 'run'}",
                             "--config.model.family=lama"])
    err = capsys.readouterr().err
    assert code == 2 and "did you mean 'llama'?" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "run" / "config.json")


def test_a_config_written_before_the_field_gets_the_family_of_the_old_rule_once_and_says_so(caplog):
    old = {"model": {"name": "q", "vocab_size": 96, "embed_dim": 32, "mlp_dim": 64, "num_layers": 2,
                     "attention": {"num_heads": 4, "num_kv_heads": 2, "qk_norm": True}}}
    with caplog.at_level(logging.INFO, logger="jaxtron.config.loader"):
        cfg = from_mapping(old)
    assert cfg.model.family == "qwen3"
    assert [r for r in caplog.records if "model.family is not set" in r.getMessage() and "'qwen3'" in r.getMessage()]
    caplog.clear()
    named = {"model": {**old["model"], "family": "qwen3"}}
    with caplog.at_level(logging.INFO, logger="jaxtron.config.loader"):
        assert from_mapping(named).model.family == "qwen3"
    assert not [r for r in caplog.records if "model.family" in r.getMessage()]
    # each shipped config names its family, so none takes this path
    for name, family in (("default.py", "llama"), ("qwen3.py", "qwen3"), ("qwen3.py:30b-a3b", "qwen3_moe"),
                         ("deepseek_v3.py", "deepseek_v3"), ("mixtral_8x7b.py", "mixtral"), ("gpt3_175b.py", "gpt3")):
        with caplog.at_level(logging.INFO, logger="jaxtron.config.loader"):
            assert load_config(os.path.join(REPO, "configs", name)).model.family == family
    assert not [r for r in caplog.records if "model.family is not set" in r.getMessage()]


def test_what_a_family_adds_reaches_the_parameter_and_flop_counts(monkeypatch):
    cfg = load_config(os.path.join(REPO, "configs", "default.py")).model
    before_params, before_flops = flops.param_count(cfg), flops.matmul_breakdown(cfg, 128)
    # a family with one more h x h matrix a token uses in each block, of the attention's output kind
    extra = dataclasses.replace(
        families.get("llama"), name="llama_plus",
        extra_params=lambda c, active: c.num_layers * c.embed_dim ** 2,
        extra_flops=lambda c, seq_len: {"attention_out": 6.0 * c.num_layers * c.embed_dim ** 2})
    declared = families.all_families()
    monkeypatch.setattr(families, "all_families", lambda: {**declared, "llama_plus": extra})
    plus = replace(cfg, family="llama_plus")
    added = cfg.num_layers * cfg.embed_dim ** 2
    assert flops.param_count(plus) == before_params + added
    after = flops.matmul_breakdown(plus, 128)
    assert after["attention_out"] == before_flops["attention_out"] + 6.0 * added
    assert {k: v for k, v in after.items() if k != "attention_out"} == \
        {k: v for k, v in before_flops.items() if k != "attention_out"}
