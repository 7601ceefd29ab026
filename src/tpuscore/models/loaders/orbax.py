"""Orbax save and restore of a scorer's model: parameters, config and tokenizer in one directory.

- `params/`: the Orbax checkpoint of the parameter tree;
- `tpuscore.json`: `{"format": 1, "config": <ModelConfig fields>}`;
- `tokenizer.json`: the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tokenizers

from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import files
from tpuscore.models.weights import Params, param_shapes
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

MARKER = "tpuscore.json"
FORMAT = 1


def is_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def save(
    path: str | Path, config: ModelConfig, params: Params, tokenizer: tokenizers.Tokenizer | None
):
    if tokenizer is None:
        raise ValueError("a scorer without a tokenizer cannot be saved")
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; save into a new directory")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", params)
        checkpointer.wait_until_finished()
    (path / MARKER).write_text(json.dumps({"format": FORMAT, "config": config.to_dict()}, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))


def restore(
    path: str | Path,
    dtype: np.dtype,
    layout_for: Callable[[ModelConfig], Layout] = lambda config: ONE_DEVICE,
) -> tuple[ModelConfig, Params, tokenizers.Tokenizer]:
    """Restore onto an abstract tree of the config's shapes in `dtype`, each parameter read
    straight into its place in `layout_for(config)` (on a mesh: only each device's shard)."""
    path = Path(path).absolute()
    meta = files.read_json(path / MARKER)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER}: format {meta.get('format')!r}, expected {FORMAT}")
    config = ModelConfig.from_dict(meta["config"])
    layout = layout_for(config)
    abstract = jax.tree_util.tree_map_with_path(
        lambda path, shape: jax.ShapeDtypeStruct(
            shape, dtype, sharding=layout.param_sharding(tuple(key.key for key in path))
        ),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path / "params", abstract)
    return config, params, files.read_tokenizer(path / "tokenizer.json")
