"""The int8 precision: projection and MLP weights int8 per output channel, activations int8 per
token, int32 accumulation, a few outlier input channels in float32 (`models/int8.py`).

One matmul against an independent numpy reference (integer arithmetic in int64), the model
against float32 within a measured bound, batch invariance in bytes, and lowering for TPU and
CUDA from abstract shapes.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SMOLLM2_135M, random_tokens, seeded_rng
from hf_reference import make_checkpoint
from tpuscore import Scorer
from tpuscore.backends import serial
from tpuscore.backends.work import StepWork
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.engine.selection import CostModel
from tpuscore.models import decoder, int8
from tpuscore.models.attention import attend
from tpuscore.models.model import (
    INT8,
    MIXED_BFLOAT16,
    Model,
    PrecisionError,
    resolve_precision,
)
from tpuscore.models.weights import param_shapes
from tpuscore.parallel.sharding import Layout

CASES = ("llama_gqa_untied", "qwen3_qknorm")
# The worst |logprob - float32 logprob| in int8 over 26 checkpoint and request draws (seeds 0-11
# and 2052208019, both cases; median 0.026; serial and prefill_extend equal on every draw):
# 0.0697, by `python benchmarks/precision_seeds.py --dtype int8 --seeds 12 --backend serial
# --backend prefill_extend` (docs/runtime.md#int8), times 1.5, rounded up to 0.01. Past it: a
# change in int8's arithmetic, or a draw worse than any measured (the replay line names the seed).
INT8_BOUND = 0.11


def reference_dot(x: np.ndarray, w: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """x [M, in] @ w [in, out] as the int8 mode defines it, written apart from `models/int8.py`:
    per output channel and per row symmetric int8 over the channels not in `channels`, integer
    products summed in int64, those channels' products in float64."""
    keep = np.ones(w.shape[0], bool)
    keep[channels] = False
    w_scale = np.abs(w[keep]).max(axis=0) / 127  # [out]
    wq = np.rint(w[keep] / w_scale).astype(np.int64)
    x_scale = np.abs(x[:, keep]).max(axis=1, keepdims=True) / 127  # [M, 1]
    xq = np.clip(np.rint(x[:, keep] / x_scale), -127, 127).astype(np.int64)
    exact = x[:, ~keep].astype(np.float64) @ w[~keep].astype(np.float64)
    return (xq @ wq) * x_scale * w_scale + exact


@pytest.mark.parametrize("n_in", [1, 2])
def test_dot_equals_numpy_reference(rng, n_in):
    """A matmul whose rows carry massive activations in a few channels: the int8 dot equals the
    reference to float32 rounding, and kept channels matter (without them it is far off)."""
    shape_in = (24,) if n_in == 1 else (4, 6)
    x = rng.standard_normal((3, 5, *shape_in)).astype(np.float32)
    w = rng.standard_normal((*shape_in, 10)).astype(np.float32)
    flat_x = x.reshape(15, 24)
    channels = np.array([2, 17, 21])
    flat_x[:, channels] *= 1000.0  # what SmolLM2's residual does in a few channels
    x = flat_x.reshape(x.shape)
    weight = jax.tree.map(lambda a: a[0], int8.quantize(w[None], n_in, channels[None]))
    got = np.asarray(int8.dot(jnp.asarray(x), weight)).reshape(15, 10)
    want = reference_dot(flat_x, w.reshape(24, 10), channels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    exact = flat_x.astype(np.float64) @ w.reshape(24, 10).astype(np.float64)
    assert 0 < np.abs(got - exact).max() < 0.05 * np.abs(exact).max()  # quantized, and close
    # The same channels quantized with the rest: the massive ones take the rows' scale.
    none_kept = jax.tree.map(lambda a: a[0], int8.quantize(w[None], n_in, np.zeros((1, 0), int)))
    crude = np.asarray(int8.dot(jnp.asarray(x), none_kept)).reshape(15, 10)
    assert np.abs(crude - exact).max() > 3 * np.abs(got - exact).max()


def test_quantize_round_trip(rng):
    """dequantize(quantize(w)) is w within half a step per output channel; kept rows exact."""
    w = rng.standard_normal((2, 12, 3, 4)).astype(np.float32)  # [L, in, *out]
    channels = np.array([[0, 5], [3, 11]])
    q = int8.quantize(w, 1, channels)
    assert q.q.dtype == np.int8 and q.scale.shape == (2, 3, 4) and q.outliers.shape == (2, 2, 3, 4)
    back = np.asarray(int8.dequantize(q))
    assert np.all(np.abs(back - w) <= np.asarray(q.scale)[:, None] / 2 + 1e-7)
    for layer in range(2):
        np.testing.assert_array_equal(back[layer, channels[layer]], w[layer, channels[layer]])
        assert not q.q[layer, channels[layer]].any()


def test_padding_rows_stay_zero():
    """A row of zeros (padding) quantizes to zeros, not NaN (its max |value| is 0)."""
    w = jax.tree.map(
        lambda a: a[0], int8.quantize(np.ones((1, 8, 3), np.float32), 1, np.array([[1]]))
    )
    np.testing.assert_array_equal(np.asarray(int8.dot(jnp.zeros((2, 8)), w)), 0.0)


def int8_pair(case: str, directory) -> tuple[Scorer, Scorer]:
    """(float32, int8) scorers on the run's random checkpoint of the case."""
    seed = int(seeded_rng(f"int8-{case}").integers(2**31))
    path = make_checkpoint(directory, case, seed=seed)
    return Scorer.from_pretrained(path, dtype="float32"), Scorer.from_pretrained(path, dtype=INT8)


def int8_gap(f32: Scorer, quantized: Scorer, case: str, backend: str) -> float:
    """The largest |logprob - float32 logprob| of `backend` in int8 on the run's request for the
    case, float32 by the `reference` backend."""
    rng = seeded_rng(f"int8-request-{case}")
    vocab = f32.config.vocab_size
    query = random_tokens(rng, int(rng.integers(20, 60)), vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 16, size=5)]
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    exact = f32.score(query, items, labels, backend="reference").logprobs
    got = quantized.score(query, items, labels, backend=backend).logprobs
    assert got.dtype == np.float32
    return float(np.max(np.abs(got - exact)))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """case -> (float32, int8) scorers on one fresh random checkpoint of the case, built once."""
    built = {}

    def get(case: str) -> tuple[Scorer, Scorer]:
        if case not in built:
            built[case] = int8_pair(case, tmp_path_factory.mktemp(case))
        return built[case]

    return get


def test_int8_holds_projection_and_mlp_weights_in_int8(pairs):
    _, quantized = pairs(CASES[0])
    model = quantized.engine.model
    assert model.precision == "int8" and quantized.dtype == jnp.float32
    for name, value in model.params["layers"].items():
        assert isinstance(value, int8.Int8Weight) == (name in MIXED_BFLOAT16), name
    assert model.params["layers"]["wq"].q.dtype == jnp.int8
    k = model.params["layers"]["w_down"].channels.shape[1]
    assert 1 <= k <= quantized.config.intermediate_size // 8
    # What users see (`Scorer.params`, `save`) is the dequantized float32 weight.
    assert quantized.params["layers"]["wq"].dtype == jnp.float32


def test_int8_step_never_widens_the_weight_stack(pairs):
    """The layer scan slices the int8 stacks natively (an s8 dynamic-slice): no step converts a
    whole stack to float32, as XLA:CPU once did to bfloat16 ones (test_precision.py)."""
    _, quantized = pairs(CASES[0])
    model = quantized.engine.model
    tokens = jnp.zeros((3, 16), jnp.int32)  # 3 rows: no activation shares a stack's leading L
    positions = jnp.broadcast_to(jnp.arange(16), (3, 16))
    causal = jnp.tril(jnp.ones((3, 16, 16), bool))
    attention = lambda q, k, v, layer: attend(q, k, v, causal, layer)  # noqa: E731
    step = jax.jit(lambda p, t, pos: decoder.forward(p, model.config, t, pos, attention))
    hlo = step.lower(model.params, tokens, positions).compile().as_text()
    for name in MIXED_BFLOAT16:
        stack = model.params["layers"][name].q.shape
        assert f"f32[{','.join(map(str, stack))}]" not in hlo, name
        assert f"s8[{','.join(map(str, stack))}]" in hlo, name


# One backend per case: every JAX backend gives the same gap to four decimals (int8's rounding
# is the backends' shared decoder's), and each compile costs seconds.
@pytest.mark.parametrize("case, backend", [(CASES[0], "serial"), (CASES[1], "prefill_extend")])
def test_int8_within_bound_of_float32(pairs, case, backend):
    """int8 scores against float32's on the run's request, within the measured bound; and not
    equal to them, so the int8 path did run."""
    assert 0 < int8_gap(*pairs(case), case, backend) < INT8_BOUND


@pytest.fixture(scope="module")
def invariant(checkpoint_dir) -> Scorer:
    return Scorer.from_pretrained(checkpoint_dir("qwen3_qknorm"), dtype=INT8, batch_invariant=True)


@pytest.mark.parametrize("backend", ["prefill_extend", "serial"])
def test_batch_invariant_int8_alone_equals_in_batch(invariant, backend):
    """Per-token activation scales and exact int32 sums: a request's bytes are the same alone
    and beside other requests (another query, the same query with other items)."""
    rng = seeded_rng(f"int8-invariant-{backend}")
    vocab = invariant.config.vocab_size

    def request(query=None):
        query = random_tokens(rng, int(rng.integers(1, 17)), vocab) if query is None else query
        items = [random_tokens(rng, int(rng.integers(0, 9)), vocab) for _ in range(3)]
        return {"query": query, "items": items, "label_token_ids": [3, 7, 11]}

    target = request()
    others = [request(), request(target["query"])]
    if backend == "prefill_extend":
        invariant.get_backend(backend).cache.clear()
    alone = invariant.score(**target, backend=backend).logprobs
    batched = invariant.score_batch([others[0], target, others[1]], backend=backend)[1].logprobs
    assert np.ascontiguousarray(batched).tobytes() == np.ascontiguousarray(alone).tobytes()


def _abstract_int8_params(config):
    """The int8 model's parameter tree as abstract shapes (k = 16 outlier channels)."""
    S = jax.ShapeDtypeStruct
    shapes = param_shapes(config)

    def leaf(name, shape):
        if name not in MIXED_BFLOAT16:
            return S(shape, jnp.float32)
        n_in = 2 if name == "wo" else 1
        L, out = shape[0], shape[1 + n_in :]
        return int8.Int8Weight(
            S(shape, jnp.int8), S((L, *out), jnp.float32), S((L, 16), jnp.int32),
            S((L, 16, *out), jnp.float32),
        )  # fmt: skip

    layers = {name: leaf(name, shape) for name, shape in shapes.pop("layers").items()}
    return {**{name: S(shape, jnp.float32) for name, shape in shapes.items()}, "layers": layers}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_int8_step_lowers_for_accelerators(platform):
    """serial's step in int8 lowers for TPU and CUDA (`jax.export`, abstract shapes): s8 x s8
    -> s32 dots are in both platforms' vocabulary."""
    config = SMOLLM2_135M
    S = jax.ShapeDtypeStruct
    step = functools.partial(serial.score_sequences, config=config)
    args = (_abstract_int8_params(config), S((8, 64), jnp.int32), S((8,), jnp.int32))
    exported = jax.export.export(jax.jit(step), platforms=[platform])(*args, S((16,), jnp.int32))
    assert "i8" in exported.mlir_module()


def test_resolve_and_price_int8():
    """auto prices matmuls at the rate of the dtype they multiply in: int8's where a profile has
    one (`tpuscore calibrate --dtype int8` writes it), else float32's."""
    assert resolve_precision("int8") == "int8"
    with pytest.raises(ValueError, match="int8"):
        resolve_precision("int4")
    profile = DeviceProfile(
        name="t", device_kinds=(), matmul_flops={"float32": 1e11, "int8": 4e11},
        memory_bandwidth=1e30, step_seconds=0.0, score_seconds=0.0, interpret_penalty=1.0,
        measured=False,
    )  # fmt: skip
    steps = [StepWork(flops=1e11, bytes=0, scores=0, peak=0)]

    def model(matmul_dtype):
        return types.SimpleNamespace(layout=Layout(), matmul_dtype=matmul_dtype)

    seconds = CostModel(profile, platform="cpu").seconds
    assert seconds(steps, model("float32")) == pytest.approx(1.0)
    assert seconds(steps, model("int8")) == pytest.approx(0.25)
    assert seconds(steps, model("bfloat16")) == pytest.approx(1.0)  # no rate: float32's


def test_int8_refused_on_a_mesh(checkpoint_dir):
    """A mesh's sharding table has no int8 weights: refused by type, before any work."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(PrecisionError, match="one device"):
        Model.build(SMOLLM2_135M, {}, INT8, Layout(mesh))


def test_int8_is_refused_off_the_cpu(monkeypatch):
    """The mode is measured on CPUs only (on an H100 it was far from float32): a model placed
    on another platform is refused, not scored wrong."""
    monkeypatch.setattr(Layout, "platform", property(lambda self: "gpu"))
    with pytest.raises(PrecisionError, match="CPU mode"):
        Model.build(SMOLLM2_135M, {}, INT8, Layout())
