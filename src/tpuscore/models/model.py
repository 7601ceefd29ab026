"""`Model`: what a backend is built from: the config, the parameters on device, their precision,
and the layout that places them and the backends' arrays (`tpuscore.parallel.sharding`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.models import decoder, int8
from tpuscore.models.adapters import AdapterStack, LoraAdapter, RowAdapters, stack_adapters
from tpuscore.models.attention import attend, within_window
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params, bits_as_bfloat16, layers_as_bits
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MIXED, INT8 = "mixed", "int8"
PRECISIONS = (*DTYPES, MIXED, INT8)
# What the mixed precision stores in bfloat16, and the int8 one in int8: the projection and MLP
# weights, which feed nothing but a matmul. Embeddings, the LM head, norms and biases stay float32.
MIXED_BFLOAT16 = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
# int8: the outlier input channels kept in float32 per layer and matmul, at most an eighth of the
# inputs (SmolLM2-135M: 16 of 576 or 1536; its massive activations sit in about that many).
OUTLIER_CHANNELS = 16
# The calibration pass that picks them: this many tokens, drawn at random from the vocabulary
# with a fixed seed (no tokenizer needed, and the same channels on every build).
CALIBRATION_TOKENS, CALIBRATION_SEED = 256, 0


class PrecisionError(ValueError):
    """A precision this model's placement cannot run."""


def resolve_precision(dtype: Any) -> str:
    """The precision `dtype` names: "float32", "bfloat16", "mixed" or "int8" (a dtype or its
    name); None: float32 on CPU, bfloat16 on accelerators.

    "mixed" multiplies bfloat16 operands into float32 accumulators in the projections and the MLP
    (`MIXED_BFLOAT16`: nearly all the FLOPs but attention's) and keeps everything else float32:
    the residual stream, norms, RoPE, attention (q.k, softmax, p.v) and its K/V, the LM head and
    its log-softmax. "bfloat16" stores every weight, and runs attention and its K/V, in bfloat16
    (with float32 accumulation, norms and softmax).

    "int8" holds `MIXED_BFLOAT16` in int8 per output channel, but for a few outlier input
    channels per layer and matmul (`OUTLIER_CHANNELS`, chosen by a calibration pass at build)
    whose rows stay float32; each token's matmul input is quantized to int8 with its own scale,
    multiplied into int32 and scaled back to float32 (`models/int8.py`). Everything else is as
    in "mixed". One device only (`PrecisionError` on a mesh); opt-in: it is not faster than
    "mixed" on every CPU (docs/runtime.md)."""
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


def _input_amax(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Each `MIXED_BFLOAT16` weight's largest |input| per input channel [L, in] over a float32
    forward pass of `CALIBRATION_TOKENS` random tokens."""
    seen: dict[str, list[np.ndarray]] = {name: [] for name in MIXED_BFLOAT16}

    def probe(name, w):
        w = jnp.asarray(w, jnp.float32)
        return int8.Probe(w, _Recorder(seen[name])) if name in MIXED_BFLOAT16 else w

    rest = {key: value for key, value in params.items() if key != "layers"}
    probed = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), rest)
    probed["layers"] = {name: probe(name, w) for name, w in params["layers"].items()}
    rng = np.random.default_rng(CALIBRATION_SEED)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, CALIBRATION_TOKENS)), jnp.int32)
    positions = jnp.arange(CALIBRATION_TOKENS)[None]
    causal = jnp.tril(jnp.ones((1, CALIBRATION_TOKENS, CALIBRATION_TOKENS), bool))

    def attention(q, k, v, layer):
        return attend(q, k, v, causal & within_window(positions, positions, layer.window), layer)

    decoder.forward(probed, config, tokens, positions, attention).block_until_ready()
    jax.effects_barrier()
    return {name: np.stack(rows) for name, rows in seen.items()}


class _Recorder:
    """A `Probe`'s host side: appends what it is sent (hashable, as a pytree's static field must
    be)."""

    def __init__(self, into: list):
        self.into = into

    def __call__(self, amax) -> None:
        self.into.append(np.asarray(amax))


def _int8(config: ModelConfig, params: Params) -> Params:
    """params with `MIXED_BFLOAT16` as `int8.Int8Weight`s and every other leaf in float32."""
    amax = _input_amax(config, params)

    def quantize(name, w):
        n_in = 2 if name == "wo" else 1
        k = min(OUTLIER_CHANNELS, amax[name].shape[1] // 8)
        channels = np.sort(np.argsort(-amax[name], axis=1, kind="stable")[:, :k], axis=1)
        return int8.quantize(w, n_in, channels)

    rest = {key: value for key, value in params.items() if key != "layers"}
    out = jax.tree.map(lambda a: np.asarray(a, np.float32), rest)
    out["layers"] = {
        name: quantize(name, w) if name in MIXED_BFLOAT16 else np.asarray(w, np.float32)
        for name, w in params["layers"].items()
    }
    return out


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
        if precision == INT8 and layout.platform != "cpu":
            # An H100 scored a tiny random model 1.76 from float32 in int8 where this CPU's
            # int8 is 0.019 away: every int8 piece is right there alone, the scanned layers are
            # not (benchmarks/gpu_int8_checks.py). Refused until a GPU run is exact.
            raise PrecisionError(
                f"dtype='int8' is a CPU mode (int8 matmuls on VNNI/AMX); this model is placed "
                f"on {layout.platform}, where it is not verified: use 'bfloat16' or 'mixed'"
            )
        if precision == INT8 and layout.mesh is not None:
            raise PrecisionError(
                f"dtype='int8' runs on one device; this model is placed on a mesh of "
                f"{layout.mesh.devices.size} devices, whose sharding table has no int8 weights"
            )
        if precision == INT8:
            placed = layout.put_params(_int8(config, params), None)
        elif precision == MIXED:
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

    def row_adapters(self, index: np.ndarray, *, split: bool = True) -> RowAdapters | None:
        """What a jitted step takes for rows whose adapters are `index` [B] (0: none), placed as
        the rows are: split over "data", or (`split=False`, a step whose rows are not split,
        such as a lone query's one-row prefill) left for jit to place as that step's tokens;
        None where the model has no adapters (the decoder's plain path). A model with adapters
        passes them for every step, base rows included, so the set of compiled shapes does not
        depend on which adapters a batch holds."""
        if self.adapters is None:
            return None
        index = np.asarray(index, np.int32)
        return RowAdapters(self.adapters, self.layout.put_rows(index) if split else index)

    @property
    def weights(self) -> Params:
        """The parameters in their own dtypes (on CPU, a copy of the bfloat16 layer weights);
        int8 weights dequantized to float32 (`int8.dequantize`)."""
        layers = {
            name: int8.dequantize(w) if isinstance(w, int8.Int8Weight) else w
            for name, w in bits_as_bfloat16(self.params["layers"]).items()
        }
        return {**self.params, "layers": layers}

    @property
    def matmul_dtype(self) -> str:
        """The dtype the bulk of the matmuls (projections and MLP) multiply in, by which a
        device profile prices them: "int8", "bfloat16" (mixed too) or "float32"."""
        return {MIXED: "bfloat16"}.get(self.precision, self.precision)
