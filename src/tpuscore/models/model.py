"""`Model`: what a backend is built from: the config, the parameters on device, their precision,
and the layout that places them and the backends' arrays (`tpuscore.parallel.sharding`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.models.adapters import AdapterStack, LoraAdapter, RowAdapters, stack_adapters
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params, bits_as_bfloat16, layers_as_bits
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MIXED = "mixed"
PRECISIONS = (*DTYPES, MIXED)
# What the mixed precision stores in bfloat16: the projection and MLP weights, which feed nothing
# but a matmul. Embeddings, the LM head, norms and biases stay float32.
MIXED_BFLOAT16 = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})


def resolve_precision(dtype: Any) -> str:
    """The precision `dtype` names: "float32", "bfloat16" or "mixed" (a dtype or its name); None:
    float32 on CPU, bfloat16 on accelerators.

    "mixed" multiplies bfloat16 operands into float32 accumulators in the projections and the MLP
    (`MIXED_BFLOAT16`: nearly all the FLOPs but attention's) and keeps everything else float32:
    the residual stream, norms, RoPE, attention (q.k, softmax, p.v) and its K/V, the LM head and
    its log-softmax. "bfloat16" stores every weight, and runs attention and its K/V, in bfloat16
    (with float32 accumulation, norms and softmax)."""
    if dtype is None:
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in PRECISIONS:
        raise ValueError(f"dtype must be one of {sorted(PRECISIONS)}, got {dtype!r}")
    return name


def base_dtype(precision: str) -> np.dtype:
    """The dtype of everything `MIXED_BFLOAT16` leaves out: weights are read in it, and attention
    and the K/V the backends keep run in it. Mixed's is float32, so it shares float32's weight
    cache entry and casts its matmul weights when `Model.build` places them."""
    return np.dtype(jnp.bfloat16 if precision == "bfloat16" else jnp.float32)


def _mixed(params: Params) -> Params:
    """params with `MIXED_BFLOAT16` in bfloat16 and every other leaf in float32."""

    def cast(path, a):
        name = path[-1].key
        return a.astype(jnp.bfloat16 if name in MIXED_BFLOAT16 else jnp.float32)

    return jax.tree_util.tree_map_with_path(cast, params)


@attrs.frozen(eq=False)
class Model:
    """A loaded model. params follow `models/weights.py`, already on device and placed by
    `layout`, in the form the decoder takes: on CPU its bfloat16 layer weights are held as their
    uint16 bits (`weights.layers_as_bits`; `weights` has them in their own dtypes). precision is
    the mode's name (`resolve_precision`), dtype its `base_dtype`: that of attention and the
    K/V. platform: where it runs ("cpu", "gpu", "tpu"), resolved once from its layout; what
    reads the platform reads it here. adapters: its LoRA adapters stacked (`models/adapters.py`),
    or None; adapter_names: their names, adapter i + 1 of the stack named adapter_names[i]."""

    config: ModelConfig
    params: Params
    dtype: np.dtype
    layout: Layout = ONE_DEVICE
    precision: str = "float32"
    platform: str = attrs.field(kw_only=True, factory=jax.default_backend)
    adapters: AdapterStack | None = attrs.field(kw_only=True, default=None)
    adapter_names: tuple[str, ...] = attrs.field(kw_only=True, default=())

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        params: Params,
        dtype: Any = None,
        layout: Layout = ONE_DEVICE,
        adapters: Mapping[str, LoraAdapter] | None = None,
    ) -> Model:
        """Put params on device in the precision `dtype` names (see `resolve_precision`), placed
        by `layout`; adapters (name -> loaded adapter), stacked once, in their order."""
        precision = resolve_precision(dtype)
        if precision == MIXED:
            placed = layout.put_params(_mixed(params), None)
        else:
            placed = layout.put_params(params, base_dtype(precision))
        platform = layout.platform
        if platform == "cpu":
            placed = layers_as_bits(placed)
        stack = stack_adapters(list(adapters.values()), config) if adapters else None
        return cls(
            config, placed, base_dtype(precision), layout, precision, platform=platform,
            adapters=stack, adapter_names=tuple(adapters or ()),
        )  # fmt: skip

    def row_adapters(self, index: np.ndarray) -> RowAdapters | None:
        """What a jitted step takes for rows whose adapters are `index` [B] (0: none), placed as
        the rows are; None where the model has no adapters (the decoder's plain path). A model
        with adapters passes them for every step, base rows included, so the set of compiled
        shapes does not depend on which adapters a batch holds."""
        if self.adapters is None:
            return None
        return RowAdapters(self.adapters, self.layout.put_rows(np.asarray(index, np.int32)))

    @property
    def weights(self) -> Params:
        """The parameters in their own dtypes (on CPU, a copy of the bfloat16 layer weights)."""
        return {**self.params, "layers": bits_as_bfloat16(self.params["layers"])}
