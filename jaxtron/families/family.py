"""What a model family declares, in one value: ``Family``.

A family is a name (``model.family``), the Hugging Face classes it is (config.json's ``architectures`` and
``model_type``), the mapping between config.json and the model config both ways, the tensor names both ways, the
mechanisms it can express (``mechanisms.py``), what its parameter and FLOP counts add to the general count, if
anything, and its test fixtures. Each family module of this package declares its families as module-level values;
the package finds them (``jaxtron.families.get``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import numpy as np

from jaxtron.config.checks import ConfigError
from jaxtron.config.model import ModelConfig


class FormatError(ConfigError):
    """A Hugging Face file or config that jaxtron cannot read or map; one sentence, exit 2."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and where it goes: ``param`` (a dotted jaxtron path), ``index`` (the position in
    the stacked parameter, a tuple), and the functions between the two layouts.

    A tensor may fill several parameters (gpt-oss's gate and up projections interleaved in one): ``also`` names the
    others, ``to_jaxtron`` then returns one array per target and ``to_hf`` takes them in that order. A quantized
    tensor is read with its companions (MXFP4's scales beside its blocks): ``to_jaxtron`` takes the arrays of
    ``hf_name`` and then of ``read_with``. Export writes the plain form, which has neither."""

    hf_name: str
    shape: tuple[int, ...]  # in the Hugging Face file
    param: str
    index: tuple[int, ...]
    to_jaxtron: Callable[..., Any]
    to_hf: Callable[..., np.ndarray]
    copy: bool = False  # a second copy of a parameter another tensor fills (DeepSeek's MTP embedding and head)
    also: tuple[tuple[str, tuple[int, ...]], ...] = ()  # more (param, index) targets
    read_with: tuple[str, ...] = ()  # more Hugging Face tensors the import reads

    def targets(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every (param, index) this tensor fills, in ``to_jaxtron``'s order."""
        return ((self.param, self.index), *self.also)

    def values(self, read: Callable[[str], np.ndarray]) -> list[np.ndarray]:
        """The target slices' values, each tensor read by ``read(name)``."""
        out = self.to_jaxtron(read(self.hf_name), *(read(name) for name in self.read_with))
        return list(out) if self.also else [out]

    def hf_value(self, get: Callable[[str, tuple[int, ...]], np.ndarray]) -> np.ndarray:
        """The tensor in its Hugging Face layout from its targets' slices, ``get(param, index)``."""
        return self.to_hf(*(get(p, i) for p, i in self.targets()))


@dataclasses.dataclass(frozen=True)
class Fixture:
    """A tiny random model of the family, written by ``scripts/hf_fixtures.py`` with transformers into
    ``tests/fixtures/hf/<name>/`` (config.json, safetensors, its logits and greedy continuation), which the parity
    tests read. ``config``: the transformers config's arguments (``AutoConfig.for_model(model_type, **config)``);
    ``seed``: its own, so that writing one leaves the others as they are."""

    name: str
    seed: int
    config: Mapping[str, Any]
    shard: str | None = None  # a safetensors shard size: several files with an index
    v4: bool = False  # config.json rewritten in the transformers 4.x form (rope_theta and rope_scaling)
    # tokens per row of its logits: 24 (tokens.npy) or more, for a mechanism that works in chunks longer than that
    # (tokens_<length>.npy); greedy generation continues each row's first length - 16 tokens by 8
    length: int = 24

    @property
    def tokens_file(self) -> str:
        """The token file its logits are of, in the fixtures' directory."""
        return "tokens.npy" if self.length == 24 else f"tokens_{self.length}.npy"

    @property
    def prompt(self) -> int:
        """The prompt length of its greedy continuation."""
        return self.length - 16


def _no_fields(hf: dict) -> dict[str, float]:
    return {}


def _adds_nothing(cfg: ModelConfig, active: bool = False) -> int:
    return 0


def _adds_no_flops(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: see the module docstring. ``mechanisms``: what a model of it may switch on beyond the core
    (grouped-query attention, SwiGLU, RMSNorm, RoPE); ``required``: what it must (Mixtral's experts)."""

    name: str
    model_type: str  # config.json's "model_type"
    architectures: tuple[str, ...]  # config.json's "architectures"; export writes the first (none: not exported)
    description: str  # one line: what sets it apart
    # config.json (a dict) and the checkpoint's tensor names -> ModelConfig fields (groups as dicts)
    model_fields: Callable[[dict, Collection[str]], dict[str, Any]]
    # ModelConfig and train.router_aux_loss -> config.json's fields but "architectures"
    hf_fields: Callable[[ModelConfig, float], dict[str, Any]]
    tensors: Callable[[ModelConfig, dict | None], Iterator[Tensor]]  # every tensor of the checkpoint, in file order
    mechanisms: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    train_fields: Callable[[dict], dict[str, float]] = _no_fields  # train.* fields config.json sets
    extra_params: Callable[[ModelConfig, bool], int] = _adds_nothing  # beyond metrics.flops.param_count's
    extra_flops: Callable[[ModelConfig, int], dict[str, float]] = _adds_no_flops  # FLOPs a token, by matmul kind
    fixtures: tuple[Fixture, ...] = ()
    # name prefixes of checkpoint tensors the family does not model (a multimodal checkpoint's vision encoder, a
    # prediction layer transformers also skips): an import leaves them out and says how many
    unmodelled: tuple[str, ...] = ()

    @property
    def exported(self) -> bool:
        return bool(self.architectures)
