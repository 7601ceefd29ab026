"""An `Engine` from a parameter tree or a checkpoint, and back to one: what `Scorer`'s
constructors and `save` do beneath the facade. The sharding layout, the model in its precision
with its LoRA adapters and the device profile for `build`; the compilation cache and the loader,
reading straight into the mesh's layout, for `load`; both for `from_checkpoint`."""

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
from tpuscore.models.loaders import orbax
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


def from_checkpoint(
    model: str | os.PathLike | None, *, revision: str | None = None,
    local_files_only: bool = False, cache_dir: str | os.PathLike | None = None,
    compilation_cache_dir: str | os.PathLike | None = None, **options: Any,
) -> Engine:  # fmt: skip
    """`build` on what `load` reads from `model` (`Scorer.from_pretrained`'s argument), named
    for servers by `loaders.model_name`; options: `build`'s (dtype, mesh and devices `load`'s
    too)."""
    config, params, tokenizer = load(
        model, dtype=options.get("dtype"), mesh=options.get("mesh"),
        devices=options.get("devices"), compilation_cache_dir=compilation_cache_dir,
        revision=revision, local_files_only=local_files_only, cache_dir=cache_dir,
    )  # fmt: skip
    return build(config, params, tokenizer, model_name=loaders.model_name(model), **options)


def save(engine: Engine, path: str | os.PathLike) -> None:
    """Write the engine's model as an Orbax checkpoint that `from_checkpoint(path)` restores."""
    orbax.save(path, engine.model.config, engine.model.weights, engine.tokenizer)
