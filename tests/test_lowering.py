"""Every jitted step of every backend lowers for TPU and for CUDA GPUs, in float32 and bfloat16.

Lowering runs here on CPU from abstract shapes (no weights, no device): it proves that the code
lowers for those platforms (a TPU user's first call would otherwise fail there), not that XLA
compiles it or how fast it runs. TPU lowering goes through `jax.export`, which also checks the
module can be serialized; the Triton GPU kernel has no serializable form, so CUDA lowering goes
through `jit(...).trace(...).lower(lowering_platforms=...)`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import GEMMA2_2B, QWEN3_0_6B, SMOLLM2_135M
from tpuscore.backends import serial
from tpuscore.backends.packed import steps as packed
from tpuscore.backends.prefill_extend import steps as prefill_extend
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.weights import param_shapes

MODELS = {
    "smollm2-135m": SMOLLM2_135M,
    "qwen3-0.6b": QWEN3_0_6B,
    "gemma2-2b": GEMMA2_2B,  # sliding windows (a traced window in the kernel), soft-caps
}
S = jax.ShapeDtypeStruct
i32, f32 = jnp.int32, jnp.float32


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu_chip(request):
    """Lowering a Pallas TPU kernel asks for the chip's profile. Test only: register one under
    this CPU's device kind, and remove it afterwards. Once per chip for the module: clearing
    JAX's caches around every case took a third of these tests' time."""
    from jax._src.pallas.mosaic import tpu_info

    kind = jax.devices()[0].device_kind
    version = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v6e": tpu_info.ChipVersion.TPU_V6E}
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(version[request.param], 1)
    jax.clear_caches()
    yield request.param
    del tpu_info.registry[kind]
    jax.clear_caches()


def steps(config: ModelConfig, dtype, platform: str) -> dict:
    """step name -> (function, abstract arguments), at small bucket shapes."""
    params = jax.tree.map(
        lambda shape: S(shape, dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    L, K, H, D = config.num_layers, config.num_kv_heads, config.head_dim, config.hidden_size
    prefix = Prefix(S((L, K, H, 256), dtype), S((L, K, 256, H), dtype), S((), i32), S((D,), f32))
    Q = 4  # stacked prefixes: queries of one prefill or mixed extend step
    prefixes = Prefix(
        S((L, Q, K, H, 256), dtype), S((L, Q, K, 256, H), dtype), S((Q,), i32), S((Q, D), f32)
    )
    labels = S((16,), i32)
    B, T = 2, 512  # packed rows of several requests
    packed_args = (
        params,
        *(S((B, T), i32), S((B, T), i32), S((B,), i32), S((B, T), i32), S((B, 32), i32)),
    )
    kernel_tiles = GpuBlockSizes() if platform == "cuda" else BlockSizes()

    def with_config(f, **static):
        return functools.partial(f, config=config, **static)

    return {
        "serial": (
            with_config(serial.score_sequences),
            (params, S((8, 64), i32), S((8,), i32), labels),
        ),
        "prefill": (
            with_config(prefill_extend.prefill, size=384),
            (params, prefix, S((1, 128), i32), S((), i32)),
        ),
        "prefill_rows": (
            with_config(prefill_extend.prefill_rows, size=384),
            (params, prefixes, S((Q, 128), i32), S((Q,), i32)),
        ),
        "extend": (
            with_config(prefill_extend.score_items),
            (params, prefix, S((64, 24), i32), S((64,), i32), labels),
        ),
        "extend_mixed": (
            with_config(prefill_extend.score_mixed_items),
            (params, prefixes, S((64,), i32), S((64, 24), i32), S((64,), i32), S((64, 16), i32)),
        ),
        "packed_dense": (
            with_config(packed.score_packed, block_sizes=None),
            (*packed_args, S((B, 16), i32)),
        ),
        "packed_segment": (
            with_config(packed.score_packed, block_sizes=kernel_tiles, interpret=False),
            (*packed_args, S((B, 16), i32)),
        ),
    }


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_every_step_lowers_for_tpu(tpu_chip, model, dtype):
    for name, (f, args) in steps(MODELS[model], DTYPES[dtype], "tpu").items():
        exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
        text = exported.mlir_module()
        assert ("tpu_custom_call" in text) == (name == "packed_segment"), name  # Mosaic kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_every_step_lowers_for_cuda(model, dtype):
    for name, (f, args) in steps(MODELS[model], DTYPES[dtype], "cuda").items():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert ("triton" in text) == (name == "packed_segment"), name  # the Triton kernel


def test_the_layer_loop_unrolls_only_where_it_is_lowered_for_a_listed_platform(monkeypatch):
    """`decoder.UNROLLED_LAYERS_ON`: a step lowered for a listed platform has no while loop over
    the layers, one lowered elsewhere keeps it, and the unrolled loop computes what the rolled
    one does."""
    from tpuscore.models import decoder
    from tpuscore.models.attention import attend

    config = ModelConfig(
        family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda shape: jnp.asarray(rng.normal(0, 0.3, shape), f32),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, 8)), i32)
    positions = jnp.arange(8)[None]
    causal = jnp.tril(jnp.ones((8, 8), bool))[None]

    def step():  # a new function each time: jit caches its trace per function
        def hidden(params, tokens, positions):
            attention = lambda q, k, v, layer: attend(q, k, v, causal, layer)  # noqa: E731
            return decoder.forward(params, config, tokens, positions, attention)

        return jax.jit(hidden)

    rolled = step()(params, tokens, positions)
    monkeypatch.setattr(decoder, "UNROLLED_LAYERS_ON", frozenset({"cpu"}))
    traced = step().trace(params, tokens, positions)
    assert "stablehlo.while" not in traced.lower().as_text()
    assert "stablehlo.while" in traced.lower(lowering_platforms=("cuda",)).as_text()
    unrolled = step()(params, tokens, positions)
    np.testing.assert_allclose(unrolled, rolled, rtol=1e-5, atol=1e-5)
