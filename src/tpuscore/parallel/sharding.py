"""Where a scorer's arrays live when it spans several chips, or several hosts.

A scorer on one device has `Layout(None)`: every method below is then the identity, and the
backends run as they always have. Given a `jax.sharding.Mesh` with axes "data" and "model":

- weights go over "model": attention heads (query and kv) and the MLP hidden dimension; the
  stacked layer axis, the norms, the embedding and the LM head are replicated;
- request rows (packed rows, item batches, prefill rows) go over "data": a step's row count is
  a multiple of the data axis;
- cached query K/V follows the weights' head sharding: kv heads over "model";
- the Pallas segment kernel, which XLA cannot partition, runs under `jax.shard_map`, each device
  on its own rows and heads.

Everything else is left to XLA's sharding propagation, which keeps the math that of one device:
sharded scores equal unsharded ones up to float rounding (the tests hold them to 1e-5).

Meshes use Auto axes, as `Mesh(...)`, MaxText, tpu-inference and sglang-jax do. A mesh with
Explicit axes (what `jax.make_mesh` makes by default in JAX 0.10) is rebuilt over the same devices
with Auto axes: the scorer's jitted steps are written for sharding propagation.

Several hosts (`jax.distributed`): every process builds the same mesh over all processes' devices
and makes the same calls. Each process feeds only its own rows
(`jax.make_array_from_process_local_data`) and reads the scores back gathered from all
(`multihost_utils.process_allgather`). docs/sharding.md states the rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpuscore.api.errors import ValidationError

if TYPE_CHECKING:  # the layout sits below the models; it reads two of a config's sizes
    from tpuscore.models.config import ModelConfig

DATA, MODEL = "data", "model"

# Per-layer weights that are split over "model" (see models/weights.py for the axes); the rest of
# the tree is replicated.
LAYER_SPECS = {
    "wq": P(None, None, MODEL, None),  # [L, D, N, H]
    "wk": P(None, None, MODEL, None),  # [L, D, K, H]
    "wv": P(None, None, MODEL, None),
    "wo": P(None, MODEL, None, None),  # [L, N, H, D]
    "bq": P(None, MODEL, None),  # [L, N, H]
    "bk": P(None, MODEL, None),
    "bv": P(None, MODEL, None),
    "w_gate": P(None, None, MODEL),  # [L, D, F]
    "w_up": P(None, None, MODEL),
    "w_down": P(None, MODEL, None),  # [L, F, D]
}
# A query's cached K/V: k [layers, K, H, P], v [layers, K, P, H]; stacked, one more axis after
# layers.
PREFIX_SPEC = P(None, MODEL)
STACKED_PREFIX_SPEC = P(None, None, MODEL)


@attrs.frozen
class Layout:
    """How a scorer's arrays are placed: on one device (mesh None) or over a mesh's "data" and
    "model" axes. Hashable, so jitted steps take it as a static argument."""

    mesh: Mesh | None = None

    @property
    def data(self) -> int:
        """Devices along "data": how many ways request rows are split."""
        return 1 if self.mesh is None else self.mesh.shape[DATA]

    @property
    def model(self) -> int:
        """Devices along "model": how many ways heads and the MLP are split."""
        return 1 if self.mesh is None else self.mesh.shape[MODEL]

    @property
    def platform(self) -> str:
        """Where its arrays live ("cpu", "gpu", "tpu"): the mesh's devices', else the default
        device's."""
        if self.mesh is None:
            return jax.default_backend()
        return self.mesh.devices.flat[0].platform

    def rows(self, n: int) -> int:
        """The padded row count of a step with n rows: a power of two, and a multiple of the data
        axis so each device gets the same number."""
        rows = 1 << max(n - 1, 0).bit_length()  # a power of two, as row buckets are
        return -(-rows // self.data) * self.data

    def param_sharding(self, path: tuple[str, ...]) -> jax.sharding.Sharding:
        """Where the parameter at `path` (("layers", "wq"), ("embed",), ...) lives."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        spec = LAYER_SPECS.get(path[-1], P()) if path[0] == "layers" else P()
        return NamedSharding(self.mesh, spec)

    def put_params(self, params: dict, dtype: np.dtype | None) -> dict:
        """The parameter tree on device in `dtype` (None: each leaf's own), each leaf placed by
        `param_sharding`."""
        if self.mesh is None:
            return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)

        def put(path, a):
            names = tuple(key.key for key in path)
            if isinstance(a, jax.Array):  # restored in place already (an Orbax checkpoint)
                return a if dtype is None else a.astype(dtype)
            # Cast on the host, so no device ever holds a whole unsharded weight.
            return jax.device_put(np.asarray(a, dtype), self.param_sharding(names))

        return jax.tree_util.tree_map_with_path(put, params)

    def put_rows(self, x: np.ndarray) -> Any:
        """A host array whose axis 0 is a step's rows, split over "data". Each process supplies
        only the rows its own devices hold."""
        if self.mesh is None:
            return x
        sharding = NamedSharding(self.mesh, P(DATA))
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        starts, stops = zip(
            *((index[0].start or 0, index[0].stop or len(x))
              for index in sharding.addressable_devices_indices_map(x.shape).values()),
            strict=True,
        )  # fmt: skip
        local = x[min(starts) : max(stops)]
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    def put_prefix(self, prefix: Any, stacked: bool = False) -> Any:
        """A `decoder.Prefix` (or a stack of them) with its K/V's kv heads over "model"."""
        if self.mesh is None:
            return prefix
        spec = STACKED_PREFIX_SPEC if stacked else PREFIX_SPEC
        kv = NamedSharding(self.mesh, spec)
        replicated = NamedSharding(self.mesh, P())
        return prefix._replace(
            k=jax.device_put(prefix.k, kv),
            v=jax.device_put(prefix.v, kv),
            length=jax.device_put(prefix.length, replicated),
            last_hidden=jax.device_put(prefix.last_hidden, replicated),
        )

    def over_shards(self, kernel: Callable, heads_axis: int = 1) -> Callable:
        """kernel(q, k, v, prefix_len, seg_start, window) (q/k/v [B, heads, T, H], or [B, T,
        heads, H] for heads_axis 2, prefix_len [B], seg_start [B, T], window [] replicated) run
        on every device for its own rows and heads."""
        if self.mesh is None:
            return kernel
        heads, rows = P(DATA, *[None] * (heads_axis - 1), MODEL), P(DATA)
        return jax.shard_map(
            kernel,
            mesh=self.mesh,
            in_specs=(heads, heads, heads, rows, rows, P()),
            out_specs=heads,
            check_vma=False,  # a pallas_call carries no varying-axis annotations
        )


ONE_DEVICE = Layout()


def make_layout(
    config: ModelConfig, mesh: Mesh | None = None, devices: Sequence[Any] | None = None
) -> Layout:
    """The layout for a mesh, or a data-parallel one over `devices`, or one device (neither).

    Raises:
        ValidationError("invalid_mesh"): both given, a mesh without exactly the axes "data" and
            "model", or a "model" axis that does not divide the kv heads and the MLP width.
    """
    if mesh is not None and devices is not None:
        raise ValidationError("invalid_mesh", "give mesh or devices, not both", "mesh")
    if devices is not None:
        devices = list(devices)
        if not devices:
            raise ValidationError("invalid_mesh", "devices is empty", "devices")
        mesh = Mesh(np.array(devices).reshape(len(devices), 1), (DATA, MODEL))
    if mesh is None:
        return ONE_DEVICE
    if not isinstance(mesh, Mesh):
        raise ValidationError(
            "invalid_mesh", f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}", "mesh"
        )
    if sorted(mesh.axis_names) != [DATA, MODEL]:
        raise ValidationError(
            "invalid_mesh",
            f"mesh axes must be {DATA!r} and {MODEL!r}, got {mesh.axis_names}",
            "mesh",
        )
    if any(t != AxisType.Auto for t in mesh.axis_types):
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
    model = mesh.shape[MODEL]
    heads, width = config.num_kv_heads, config.intermediate_size
    if heads % model or width % model:
        raise ValidationError(
            "invalid_mesh",
            f"the mesh's {MODEL!r} axis has {model} devices, which must divide the model's "
            f"{heads} kv heads and its MLP width {width}; use a {MODEL!r} axis size that "
            f"divides {math.gcd(heads, width)}",
            "mesh",
        )
    return Layout(mesh)


def broadcast_from_leader(obj: Any) -> Any:
    """Process 0's `obj` (anything JSON can carry) on every process; the others' `obj` is
    ignored. How one process that receives requests hands them to the rest (docs/sharding.md).
    One process: `obj` itself."""
    if jax.process_count() == 1:
        return obj
    leader = jax.process_index() == 0
    payload = np.frombuffer(json.dumps(obj).encode(), np.uint8) if leader else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buffer = np.zeros(size, np.uint8)
    buffer[: len(payload)] = payload
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())


def to_host(x: Any) -> np.ndarray:
    """A device array as a host array; one spread over several processes is gathered from all."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
