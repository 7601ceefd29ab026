"""Shared-prefix segment attention on GPUs: the segment kernel's GPU twin, in Pallas on Triton.

The same function as the TPU kernel in `tpu.py` (the mask rule, O(T) metadata, jnp reference and
shape checks of `mask.py`), restructured for GPU lowerings. The TPU kernel walks KV tiles on a
sequential grid axis with VMEM scratch accumulators and scalar prefetch, which Pallas's GPU
lowerings do not support. Here the grid is (query tile, batch, kv head) and each program loops
over KV tiles itself, carrying the online-softmax state in registers. The loop visits only the
tiles that hold a visible key: the prefix tiles, then the tiles from the tile's first segment
start to its last row. That is exactly the set the TPU kernel computes, so `executed_tiles`
counts the same number on either; `tpuscore.kernels.segment.segment_attention` runs this kernel
for `GpuBlockSizes` tiles.

Why Triton and not Mosaic GPU: Triton runs on every CUDA GPU JAX supports (Ampere, Hopper,
Blackwell), and its programming model (one program per output tile, a loop over KV inside) is
what this kernel needs; Mosaic GPU targets Hopper and later and asks for explicit warpgroup and
TMA pipelining, which would double the code for a kernel that is bound by its two matmuls.

Most of a long query's tiles need no mask: every row of the query tile sees every key of a
prefix tile that ends before the tile's first row and before the query's end, when no window
cuts it (the seeds' workload: an item tile's ~32 query tiles against its one or two own). Those
tiles skip the mask's comparisons and selects (`mask_every_tile` keeps them, for comparison);
the tiles are still visited in the same order, so the sums differ by float32 rounding at most.

GQA: K and V tiles are loaded once per KV step and used for all G query heads of their kv head.
Triton wants power-of-two block shapes, so the head dim is zero-padded to one in the wrapper
(zeros change no dot product) and G is unrolled instead of reshaped.

Axis letters as in `mask.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tpuscore.kernels.segment import mask


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile sizes: block_q query rows per program, block_kv keys per loop step. Triton needs
    powers of two of at least 16 (its dot's smallest tile). num_warps and num_stages go to
    Triton: 4 warps and 2 stages suit 64-row tiles with head dims up to 128 on A100/H100."""

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    mask_every_tile: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or not _power_of_two(value):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.mask_every_tile, bool):
            raise ValueError(f"mask_every_tile must be a bool, got {self.mask_every_tile!r}")

    @property
    def tile(self) -> int:
        """The sequence length must be a multiple of this."""
        return max(self.block_q, self.block_kv)


# The sweep's best tiles per GPU kind, head dim and dtype (`benchmarks/triton_sweep.py --write`).
TILES_FILE = pathlib.Path(__file__).with_name("gpu_tiles.json")


def tiles_key(head_dim: int, dtype) -> str:
    return f"head_dim={head_dim},dtype={jnp.dtype(dtype).name}"


def tuned_block_sizes(device_kind: str, head_dim: int, dtype) -> GpuBlockSizes:
    """The swept best tiles for this GPU kind (`jax.Device.device_kind`), head dim and dtype,
    else the defaults."""
    swept = json.loads(TILES_FILE.read_text()).get(device_kind, {})
    return GpuBlockSizes(**swept.get(tiles_key(head_dim, dtype), {}))


def _kernel(
    meta_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, tiles_ref, *, scale, softcap, block_kv, masked
):
    """One query tile of one kv head: q_ref [G, block_q, H], k/v_ref [T, H], seg_ref [block_q],
    meta_ref [4] = (prefix_len, the tile's first segment start, its first position, window)."""
    i = pl.program_id(0)
    G, block_q, H = q_ref.shape
    prefix_len, first_key, first_pos, window = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    rows = i * block_q + jnp.arange(block_q)
    seg_start = seg_ref[...]
    pos = rows - jnp.maximum(seg_start - prefix_len, 0)
    last_block = ((i + 1) * block_q - 1) // block_kv
    # Visible tiles (`mask.visible_blocks`): the query's [prefix_from, prefix_to), then
    # [segment_from, last_block]; never past the diagonal.
    prefix_from, prefix_to, segment_lo, _ = mask.visible_blocks(
        i, prefix_len, first_key, first_pos, window, block_q, block_kv
    )
    prefix_to = jnp.minimum(prefix_to, last_block + 1)
    prefix_from = jnp.minimum(prefix_from, prefix_to)
    segment_from = jnp.maximum(prefix_to, segment_lo)
    qs = [q_ref[g] for g in range(G)]
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def step(j, carry, *, every_key_visible=False):
        k = k_ref[pl.ds(j * block_kv, block_kv), :]
        v = v_ref[pl.ds(j * block_kv, block_kv), :]
        if not every_key_visible:
            c = (j * block_kv + jnp.arange(block_kv))[None, :]
            in_prefix = (c < prefix_len) & (c > pos[:, None] - window)
            in_segment = (c >= seg_start[:, None]) & (c > rows[:, None] - window)
            visible = (c <= rows[:, None]) & (in_prefix | in_segment)
        out = []
        for q, (acc, m_prev, l_prev) in zip(qs, carry, strict=True):
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )  # fmt: skip
            s = mask.soft_cap(s * scale, softcap)
            if not every_key_visible:
                s = jnp.where(visible, s, mask.MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            p = jnp.exp(s - m_next[:, None])
            if not every_key_visible:
                p = jnp.where(visible, p, 0.0)
            alpha = jnp.exp(m_prev - m_next)
            pv = jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )  # fmt: skip
            out.append((alpha[:, None] * acc + pv, m_next, alpha * l_prev + jnp.sum(p, axis=1)))
        return tuple(out)

    init = tuple(
        (
            jnp.zeros((block_q, H), jnp.float32),
            jnp.full((block_q,), mask.MASK_VALUE, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
        for _ in range(G)
    )
    # The prefix tiles every row sees whole (module doc): [full_from, full_to), unmasked.
    full_to = jnp.minimum(prefix_len, i * block_q + 1) // block_kv
    full_to = jnp.clip(full_to, prefix_from, prefix_to)
    full_from = jnp.where(window == mask.NO_WINDOW, prefix_from, full_to)
    if masked:
        full_from = full_to = prefix_to
    unmasked = functools.partial(step, every_key_visible=True)
    carry = jax.lax.fori_loop(prefix_from, full_from, step, init)
    carry = jax.lax.fori_loop(full_from, full_to, unmasked, carry)
    carry = jax.lax.fori_loop(full_to, prefix_to, step, carry)
    carry = jax.lax.fori_loop(segment_from, last_block + 1, step, carry)
    for g, (acc, _, total) in enumerate(carry):  # every row sees its own key: total > 0
        o_ref[g] = (acc / total[:, None]).astype(o_ref.dtype)
    count = prefix_to - prefix_from + jnp.maximum(last_block + 1 - segment_from, 0)
    tiles_ref[...] = jnp.full(tiles_ref.shape, count, jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale", "softcap"))
def attention(q, k, v, prefix_len, seg_start, window, block_sizes, interpret, scale, softcap):
    """`segment_attention` on GPU tiles: the output and the number of tiles computed."""
    B, N, T, H = q.shape
    K = k.shape[1]
    G = N // K
    bq, bkv = block_sizes.block_q, block_sizes.block_kv
    nq = T // bq
    Hp = max(16, pl.next_power_of_2(H))
    if Hp != H:  # zero padding changes no dot product; the extra output columns are dropped
        pad = [(0, 0)] * 3 + [(0, Hp - H)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    seg_start = seg_start.astype(jnp.int32)
    prefix_len = prefix_len.astype(jnp.int32)
    first_key = mask.first_segment_key(seg_start, bq)  # [B, nq]
    first_pos = mask.first_position(prefix_len, seg_start, bq)  # [B, nq]
    prefix = jnp.broadcast_to(prefix_len[:, None], (B, nq))
    window = jnp.full((B, nq), mask.NO_WINDOW if window is None else window, jnp.int32)
    meta = jnp.stack([prefix, first_key, first_pos, window], axis=-1)  # [B, nq, 4]
    scale = H**-0.5 if scale is None else scale
    kernel = functools.partial(
        _kernel, scale=scale, softcap=softcap, block_kv=bkv, masked=block_sizes.mask_every_tile
    )
    o, tiles = pl.pallas_call(
        kernel,
        grid=(nq, B, K),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
            pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, None, G, bq, Hp), lambda i, b, h: (b, h, 0, i, 0)),
            pl.BlockSpec((None, None, T, Hp), lambda i, b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, T, Hp), lambda i, b, h: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, G, bq, Hp), lambda i, b, h: (b, h, 0, i, 0)),
            pl.BlockSpec((None, None, None, 16), lambda i, b, h: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, G, T, Hp), q.dtype),
            jax.ShapeDtypeStruct((B, K, nq, 16), jnp.int32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="segment_attention_gpu",
    )(meta, seg_start, q.reshape(B, K, G, T, Hp), k, v)
    return o.reshape(B, N, T, Hp)[..., :H], tiles[..., 0].sum()
