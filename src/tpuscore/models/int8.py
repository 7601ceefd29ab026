"""The int8 precision's weights and matmul (LLM.int8()-style: int8 with float32 outliers).

A projection or MLP weight w [*in, *out] (`MIXED_BFLOAT16`'s seven) is held as an `Int8Weight`:
int8 per output channel, except a few outlier input channels whose rows stay float32. A matmul
x @ w then quantizes each token's row of x to int8 (its own scale: row-local, so a row's result
does not depend on the rows beside it), multiplies int8 x int8 into int32 (exact, so the sum's
order cannot change it), scales the int32 sums back to float32 and adds the outlier channels'
float32 product.

Why the outliers: SmolLM2's massive activations (a few residual channels reach ~24,000; see
docs/runtime.md, "Precision") would set a token's int8 step so coarse that every other channel
rounds to zero. The channels are fixed per layer and matmul input, chosen once when the model is
built (`Model.build`'s calibration pass), which keeps the mode batch-invariant; a per-row choice
would gather weight rows per token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32
# Symmetric int8: -127..127, so a value and its negation round alike (-128 is never produced).
QMAX = 127


class Int8Weight(NamedTuple):
    """A weight w [*in, *out] in int8 (with a leading L axis when stacked over layers).

    q int8 [*in, *out]: round(w / scale), the outlier channels' rows zero.
    scale float32 [*out]: max |w| over the other input channels / 127, per output channel.
    channels int32 [k]: the outlier input channels, as indices into the flattened *in.
    outliers float32 [k, *out]: those channels' rows of w, unquantized.
    """

    q: jax.Array
    scale: jax.Array
    channels: jax.Array
    outliers: jax.Array


def quantize(w: np.ndarray, n_in: int, channels: np.ndarray) -> Int8Weight:
    """A stack of weights w [L, *in, *out] (n_in input axes) as an `Int8Weight`, keeping the
    input channels [L, k] of each layer in float32. On the host, in numpy."""
    w = np.asarray(w, np.float32)
    L, in_shape, out_shape = w.shape[0], w.shape[1 : 1 + n_in], w.shape[1 + n_in :]
    flat = w.reshape(L, math.prod(in_shape), math.prod(out_shape))
    index = np.asarray(channels, np.int64)[:, :, None]
    outliers = np.take_along_axis(flat, index, axis=1)  # [L, k, out]
    rest = flat.copy()
    np.put_along_axis(rest, index, 0.0, axis=1)
    scale = np.abs(rest).max(axis=1) / QMAX  # [L, out]
    # An all-zero output channel keeps scale 0: its q is 0 and so is its product.
    q = np.rint(rest / np.where(scale > 0, scale, 1.0)[:, None]).astype(np.int8)
    return Int8Weight(
        q=q.reshape(w.shape),
        scale=scale.astype(np.float32).reshape(L, *out_shape),
        channels=np.asarray(channels, np.int32),
        outliers=outliers.reshape(L, -1, *out_shape),
    )


def dequantize(w: Int8Weight) -> jax.Array:
    """The float32 weight [L, *in, *out] an `Int8Weight` stands for (q x scale, the outlier rows
    put back): what `Model.weights` shows and the reference backend computes with."""
    q, scale = np.asarray(w.q), np.asarray(w.scale, np.float32)
    L, out_shape = q.shape[0], scale.shape[1:]
    flat = q.reshape(L, -1, math.prod(out_shape)).astype(np.float32) * scale.reshape(L, 1, -1)
    index = np.asarray(w.channels, np.int64)[:, :, None]
    rows = np.asarray(w.outliers, np.float32).reshape(L, -1, flat.shape[-1])
    np.put_along_axis(flat, index, rows, axis=1)
    return jnp.asarray(flat.reshape(q.shape))


def quantize_rows(x: jax.Array, outlier: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., in] without its outlier channels (a bool [in]) as int8 [..., in] and each row's
    float32 step [..., 1]: the row's largest |value| / 127. A row of zeros (padding) gives
    zeros."""
    rest = jnp.where(outlier, 0.0, x)
    amax = jnp.max(jnp.abs(rest), axis=-1, keepdims=True)
    step = jnp.where(amax > 0, amax / QMAX, 1.0)
    return jnp.clip(jnp.round(rest / step), -QMAX, QMAX).astype(jnp.int8), step


def dot(x: jax.Array, w: Int8Weight) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> float32 [..., *out] (one layer's `Int8Weight`, no L axis):
    int8 rows x int8 weights into int32, scaled back, plus the outlier channels in float32."""
    n_in = w.q.ndim - w.scale.ndim
    lead, out_shape = x.shape[: x.ndim - n_in], w.scale.shape
    x = x.reshape(*lead, -1).astype(f32)  # [..., in]
    outlier = jnp.zeros(x.shape[-1], bool).at[w.channels].set(True)
    xq, step = quantize_rows(x, outlier)
    q = w.q.reshape(x.shape[-1], -1)
    total = jnp.dot(xq, q, preferred_element_type=jnp.int32).astype(f32)
    y = total * step * w.scale.reshape(-1)
    if w.channels.shape[0]:
        kept = jnp.take(x, w.channels, axis=-1)  # [..., k]
        outliers = w.outliers.reshape(w.channels.shape[0], math.prod(out_shape))
        y = y + jnp.dot(kept, outliers, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*lead, *out_shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Probe:
    """A float32 weight whose matmuls report their input's max |value| per input channel
    [in] to `seen` on the host (through `jax.debug.callback`, in order): the calibration pass
    that picks each layer's outlier channels runs the decoder over weights wrapped so."""

    w: jax.Array
    seen: Callable[[np.ndarray], None]


jax.tree_util.register_dataclass(Probe, data_fields=["w"], meta_fields=["seen"])


def report(spec: str, x: jax.Array, w: Probe) -> jax.Array:
    """Send the max |value| per input channel of x (the einsum `spec`'s left operand, its
    contracted axes last, as in every projection) to `w.seen`, in the order the matmuls run;
    the float32 weight to multiply by."""
    inputs, weights = spec.split("->")[0].split(",")
    n_in = len(set(inputs) & set(weights))
    flat = x.reshape(-1, math.prod(x.shape[x.ndim - n_in :]))
    jax.debug.callback(w.seen, jnp.max(jnp.abs(flat.astype(f32)), axis=0), ordered=True)
    return w.w
