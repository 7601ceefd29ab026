"""`Model`: what a backend is built from: the config, the parameters on device, their dtype, and
the layout that places them and the backends' arrays (`tpuscore.parallel.sharding`)."""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any) -> np.dtype:
    """float32 on CPU, bfloat16 on accelerators, unless asked: "float32" or "bfloat16"."""
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return np.dtype(DTYPES[name])


@attrs.frozen(eq=False)
class Model:
    """A loaded model. params follow `models/weights.py`, already on device in `dtype`, placed
    by `layout`."""

    config: ModelConfig
    params: Params
    dtype: np.dtype
    layout: Layout = ONE_DEVICE

    @classmethod
    def build(
        cls, config: ModelConfig, params: Params, dtype: Any = None, layout: Layout = ONE_DEVICE
    ) -> Model:
        """Put params on device in `dtype` (see `resolve_dtype`), placed by `layout`."""
        dtype = resolve_dtype(dtype)
        return cls(config, layout.put_params(params, dtype), dtype, layout)
