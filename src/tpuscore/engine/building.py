"""An `Engine` from a parameter tree or a checkpoint: what `Scorer`'s constructors do beneath
the facade. The sharding layout, the model in its precision with its LoRA adapters and the
device profile for `build`; the compilation cache and the loader, reading straight into the
mesh's layout, for `load`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import tokenizers

from tpuscore.engine import compilation_cache
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.engine.runner import Engine
from tpuscore.models import loaders
from tpuscore.models.adapters import LoraAdapter, load_adapters
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model, base_dtype, resolve_precision
from tpuscore.models.weights import Params
from tpuscore.parallel import sharding

# What `Scorer.from_pretrained` takes for them, and `build` below.
Adapters = Mapping[str, "str | os.PathLike | LoraAdapter"]
BackendOptions = Mapping[str, Mapping[str, Any]]
Profile = DeviceProfile | str | os.PathLike


def build(
    config: ModelConfig, params: Params, tokenizer: tokenizers.Tokenizer | None, *,
    dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    adapters: Adapters | None = None, profile: Profile | None = None, **engine_options: Any,
) -> Engine:  # fmt: skip
    """An engine on the model laid out over `mesh` (or `devices`); profile: a `DeviceProfile`
    or the path of one; engine_options: `Engine`'s other arguments."""
    layout = sharding.make_layout(config, mesh, devices)
    model = Model.build(config, params, dtype, layout, load_adapters(adapters, config))
    if profile is not None and not isinstance(profile, DeviceProfile):
        profile = DeviceProfile.load(profile)
    return Engine(model, tokenizer, profile=profile, **engine_options)


def load(
    model: str | os.PathLike | None, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    compilation_cache_dir: str | os.PathLike | None = None, **loader_options: Any,
) -> tuple[ModelConfig, Params, tokenizers.Tokenizer | None]:  # fmt: skip
    """The checkpoint's config, parameters (in the precision's base dtype, placed as `build`
    lays them out) and tokenizer, with the compilation cache enabled first; loader_options:
    `loaders.load`'s revision, local_files_only, cache_dir."""
    compilation_cache.enable(compilation_cache_dir)
    return loaders.load(
        model, dtype=base_dtype(resolve_precision(dtype)),
        layout_for=lambda c: sharding.make_layout(c, mesh, devices), **loader_options,
    )  # fmt: skip
