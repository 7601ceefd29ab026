"""Sharding checks on 8 CPU devices. JAX fixes its device count when it starts, so
tests/test_sharding.py runs this file in a pytest subprocess with JAX_NUM_CPU_DEVICES=8; run
alone it skips. Every check compares a sharded scorer with an unsharded one on the same random
weights: scores within 1e-5 in float32."""

import dataclasses

import jax
import numpy as np
import pytest
import tokenizers
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpuscore import Scorer, ValidationError
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import orbax as checkpoint
from tpuscore.models.weights import param_shapes

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs JAX_NUM_CPU_DEVICES=8 (tests/test_sharding.py sets it)"
)

# kv heads and MLP width divisible by every model axis below; biases and q/k norms present, so
# every sharded parameter kind is exercised.
CONFIG = ModelConfig(
    family="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    qkv_bias=True,
    qk_norm=True,
)
# Model-parallel alone and both axes; a data-parallel mesh alone is
# test_devices_builds_a_data_parallel_mesh's.
MESHES = [(1, 8), (2, 4)]
BACKENDS = ["serial", "reference", "prefill_extend", "packed_dense", "packed_segment"]
TOL = 1e-5


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


@pytest.fixture(scope="module")
def params():
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda shape: rng.normal(0, 0.3, shape).astype(np.float32),
        param_shapes(CONFIG),
        is_leaf=lambda x: isinstance(x, tuple),
    )


@pytest.fixture(scope="module")
def unsharded(params):
    return Scorer(CONFIG, params, None, dtype="float32")


@pytest.fixture
def requests(rng):
    """Five requests with different queries and one repeating a query with other labels; four
    items each, of 1-4 tokens. Short queries keep every step in one token bucket: a compile per
    step shape and mesh is what these checks spend their time on."""

    def tokens(n):
        return rng.integers(1, CONFIG.vocab_size, n).tolist()

    shared = tokens(12)
    out = [
        {"query": tokens(int(rng.integers(3, 13))), "label_token_ids": [5, 7, 11]} for _ in range(4)
    ] + [{"query": shared, "label_token_ids": [5, 9]}, {"query": shared, "label_token_ids": [5]}]
    for request in out:
        request["items"] = [tokens(int(rng.integers(1, 5))) for _ in range(4)]
    return out


def assert_same_scores(sharded, unsharded, requests, backend):
    got = sharded.score_batch(requests, backend=backend)
    want = unsharded.score_batch(requests, backend=backend)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=TOL, rtol=0)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_backend_sharded_equals_unsharded(shape, params, unsharded, requests):
    scorer = Scorer(CONFIG, params, None, dtype="float32", mesh=mesh_of(*shape))
    for backend in BACKENDS:
        assert_same_scores(scorer, unsharded, requests, backend)


def test_a_warmed_mesh_compiles_nothing_more(params, requests, rng):
    """The shape set on a mesh (rows are multiples of its data axis): `warmup(all=True)` compiles
    exactly the listed shapes, then requests within the limits compile nothing. jit keys an
    executable by its inputs' shardings as well as shapes: every prefix a step takes must be
    placed as warmup places its zeros."""
    from helpers import compile_events

    limits = {"query_tokens": 16, "item_tokens": 4, "labels": 3}
    backends = ["prefill_extend", "packed_dense"]
    # Small budgets: a few row buckets (19 shapes, every prefill_extend step among them).
    options = {name: {"activation_bytes": 1 << 18} for name in backends}
    scorer = Scorer(
        CONFIG, params, None, dtype="float32", mesh=mesh_of(2, 4), backend_options=options
    )
    shapes = scorer.shapes(limits, backends=backends)
    assert all(s.shape[0] % 2 == 0 for s in shapes if s.step in ("score_packed", "score_items"))
    compiles = compile_events()
    scorer.warmup(all=True, limits=limits, backends=backends)
    assert len(compiles) == len(shapes)
    for call in range(8):
        extra = [
            {
                "query": rng.integers(1, CONFIG.vocab_size, int(rng.integers(1, 17))).tolist(),
                "items": [rng.integers(1, CONFIG.vocab_size, int(rng.integers(0, 5))).tolist()]
                * int(rng.integers(1, 9)),
                "label_token_ids": [5, 7, 11][: int(rng.integers(1, 4))],
            }
        ]
        scorer.score_batch(requests + extra, backend=backends[call % 2])
    assert len(compiles) == len(shapes), "a request within the limits compiled on the mesh"
    shared = rng.integers(1, CONFIG.vocab_size, 8).tolist()
    for _ in range(4):  # prompt log-probabilities: prompts of at most query_tokens, some sharing
        prompts = [
            shared[: int(rng.integers(1, 9))]
            + rng.integers(1, CONFIG.vocab_size, int(rng.integers(0, 9))).tolist()
            for _ in range(int(rng.integers(1, 6)))
        ]
        scorer.prompt_logprobs(prompts)
    assert len(compiles) == len(shapes), "prompt_logprobs within the limits compiled on the mesh"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A PEFT LoRA adapter of CONFIG (r=2 on q, v and down), with random A and B."""
    import json

    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("adapter")
    rng = np.random.default_rng(1)
    q, kv = CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim
    dims = {"self_attn.q_proj": (64, q), "self_attn.v_proj": (64, kv), "mlp.down_proj": (128, 64)}
    tensors = {}
    for layer in range(CONFIG.num_layers):
        for module, (d_in, d_out) in dims.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.3, (2, d_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.3, (d_out, 2)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": list(dims)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def test_adapters_sharded_equal_unsharded(params, requests, adapter_dir, rng):
    """A model with adapters on a mesh: a lone query's one-row prefill took its adapter index
    split over "data" (IndivisibleError on every prefill_extend request, base rows too, and on
    loglikelihood); now prefill_extend equals the unsharded scorer, under the adapter and not.
    prefill_extend only: the other backends never prefill one row, and each costs compiles."""
    adapters = {"a": adapter_dir}
    unsharded = Scorer(CONFIG, params, None, dtype="float32", adapters=adapters)
    scorer = Scorer(CONFIG, params, None, dtype="float32", adapters=adapters, mesh=mesh_of(2, 1))
    mixed = [{**r, "adapter": "a" if i % 2 else None} for i, r in enumerate(requests[-3:])]
    assert_same_scores(scorer, unsharded, mixed, "prefill_extend")
    context = rng.integers(1, CONFIG.vocab_size, 9).tolist()
    continuations = [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (1, 3)]
    got = scorer.loglikelihood(context, continuations, adapter="a")
    want = unsharded.loglikelihood(context, continuations, adapter="a")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, atol=TOL, rtol=0)


def test_weights_and_cached_kv_follow_the_model_axis(params, requests):
    mesh = mesh_of(2, 4)
    scorer = Scorer(CONFIG, params, None, dtype="float32", mesh=mesh)
    layers = scorer.params["layers"]
    for name, spec in [
        ("wq", P(None, None, "model", None)),
        ("wk", P(None, None, "model", None)),
        ("wo", P(None, "model", None, None)),
        ("w_gate", P(None, None, "model")),
        ("w_down", P(None, "model", None)),
        ("attn_norm", P()),
    ]:
        assert layers[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), name
    scorer.score_batch(requests[:2], backend="prefill_extend")
    cache = scorer.get_backend("prefill_extend").cache
    prefix = cache.lookup(np.asarray(requests[0]["query"], np.int32)).value
    kv = NamedSharding(mesh, P(None, "model"))
    assert prefix.k.sharding.is_equivalent_to(kv, prefix.k.ndim)
    assert prefix.v.sharding.is_equivalent_to(kv, prefix.v.ndim)


def test_mixed_weights_keep_the_model_axis_as_bits(params, requests):
    """On CPU mixed holds its bfloat16 layer weights as uint16 bits (`weights.layers_as_bits`):
    placed as their float32 originals would be, given back as bfloat16 by `Scorer.params`, and
    scored as the unsharded mixed scorer scores, up to bfloat16's rounding: the model axis
    reorders float32 sums, and an ulp there can flip the rounding of a matmul's bfloat16 input
    (2**-9 of it). Measured over 12 random checkpoints x 3 backends: the median difference is
    5e-7, but 5 of 36 score sets hold one such flip, which moves a logprob by 0.8-1.1e-3 (a
    tenth of mixed's own distance from float32 there). So most scores must agree to float32's
    1e-5, and every score within 2**-8, a bfloat16 ulp at 1."""
    mesh = mesh_of(2, 4)
    scorer = Scorer(CONFIG, params, None, dtype="mixed", mesh=mesh)
    held, given = scorer.engine.model.params["layers"], scorer.params["layers"]
    spec = NamedSharding(mesh, P(None, None, "model", None))
    assert held["wq"].dtype == np.uint16 and given["wq"].dtype == jax.numpy.bfloat16
    assert held["wq"].sharding.is_equivalent_to(spec, 4)
    assert given["wq"].sharding.is_equivalent_to(spec, 4)
    unsharded = Scorer(CONFIG, params, None, dtype="mixed")
    # packed_segment on a CPU with AVX-512 BF16: the kernel's bfloat16 dots, each device its heads
    for backend in ("serial", "prefill_extend", "packed_dense", "packed_segment"):
        got = scorer.score_batch(requests, backend=backend)
        want = unsharded.score_batch(requests, backend=backend)
        diffs = np.concatenate(
            [np.abs(g.logprobs - w.logprobs).ravel() for g, w in zip(got, want, strict=True)]
        )
        assert np.median(diffs) < 1e-5, (backend, np.median(diffs))
        assert diffs.max() < 2**-8, (backend, diffs.max())


def test_loglikelihood_sharded_equals_unsharded(params, unsharded, rng):
    scorer = Scorer(CONFIG, params, None, dtype="float32", mesh=mesh_of(2, 4))
    context = rng.integers(1, CONFIG.vocab_size, 30).tolist()
    continuations = [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (1, 4, 7)]
    got = scorer.loglikelihood(context, continuations)
    want = unsharded.loglikelihood(context, continuations)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, atol=TOL, rtol=0)
        assert g.is_greedy == w.is_greedy


def test_prompt_logprobs_sharded_equals_unsharded(params, unsharded, rng):
    scorer = Scorer(CONFIG, params, None, dtype="float32", mesh=mesh_of(2, 4))
    context = rng.integers(1, CONFIG.vocab_size, 20).tolist()
    prompts = [context + rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (0, 3, 6)]
    got = scorer.prompt_logprobs(prompts)
    want = unsharded.prompt_logprobs(prompts)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, atol=TOL, rtol=0)
        np.testing.assert_allclose(g.top_logprobs, w.top_logprobs, atol=TOL, rtol=0)


def test_devices_builds_a_data_parallel_mesh(params, unsharded, requests):
    scorer = Scorer(CONFIG, params, None, dtype="float32", devices=jax.devices()[:4])
    assert dict(scorer.mesh.shape) == {"data": 4, "model": 1}
    assert_same_scores(scorer, unsharded, requests, "packed_dense")


def test_an_explicit_axes_mesh_runs_as_auto(params, unsharded, requests):
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes in JAX 0.10
    scorer = Scorer(CONFIG, params, None, dtype="float32", mesh=mesh)
    assert all(t == jax.sharding.AxisType.Auto for t in scorer.mesh.axis_types)
    assert_same_scores(scorer, unsharded, requests, "packed_dense")


@pytest.mark.parametrize(
    "mesh, match",
    [
        (lambda: mesh_of(1, 1), None),
        (lambda: Mesh(np.array(jax.devices()[:3]).reshape(1, 3), ("data", "model")), "divide"),
        (lambda: Mesh(np.array(jax.devices()[:2]), ("batch",)), "axes"),
    ],
)
def test_bad_meshes_are_refused_clearly(params, mesh, match):
    if match is None:  # a 1x1 mesh is fine
        Scorer(CONFIG, params, None, dtype="float32", mesh=mesh())
        return
    with pytest.raises(ValidationError, match=match) as raised:
        Scorer(CONFIG, params, None, dtype="float32", mesh=mesh())
    assert raised.value.code == "invalid_mesh"
    with pytest.raises(ValidationError, match="not both"):
        Scorer(CONFIG, params, None, mesh=mesh_of(1, 1), devices=jax.devices()[:1])


def test_orbax_restores_straight_into_the_sharded_layout(params, unsharded, requests, tmp_path):
    vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    checkpoint.save(tmp_path / "ckpt", CONFIG, params, tokenizer)
    mesh = mesh_of(2, 4)
    restored = Scorer.from_pretrained(tmp_path / "ckpt", dtype="float32", mesh=mesh)
    assert dataclasses.asdict(restored.config) == dataclasses.asdict(CONFIG)
    wq = restored.params["layers"]["wq"]
    assert wq.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "model", None)), 4)
    # Each device holds its own shard only: a quarter of the kv heads' query heads.
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 64, 4, 8)}
    assert_same_scores(restored, unsharded, requests, "prefill_extend")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sharded_segment_kernel_lowers_for_tpu_and_cuda(platform):
    """packed_segment's kernel under shard_map on a 2x4 mesh lowers with the Mosaic (TPU) or
    Triton (CUDA) kernel in it. Lowering only: not compiled, not run (no such devices here)."""
    from jax._src.pallas.mosaic import tpu_info

    from tpuscore.backends.packed.steps import score_packed
    from tpuscore.kernels.segment.gpu import GpuBlockSizes
    from tpuscore.kernels.segment.tpu import BlockSizes
    from tpuscore.parallel.sharding import make_layout

    layout = make_layout(CONFIG, mesh_of(2, 4))
    params = jax.tree_util.tree_map_with_path(
        lambda path, shape: jax.ShapeDtypeStruct(
            shape, np.float32, sharding=layout.param_sharding(tuple(k.key for k in path))
        ),
        param_shapes(CONFIG),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    rows = NamedSharding(layout.mesh, P("data"))
    B, T = 4, 256

    def S(shape):
        return jax.ShapeDtypeStruct(shape, np.int32, sharding=rows)

    args = (params, S((B, T)), S((B, T)), S((B,)), S((B, T)), S((B, 8)), S((B, 16)))
    step = jax.jit(
        score_packed,
        static_argnames=("config", "block_sizes", "layout", "interpret"),
    )
    static = {"config": CONFIG, "layout": layout, "interpret": False}
    if platform == "tpu":
        # Test only: lowering a Pallas TPU kernel asks for a chip profile; register v6e's under
        # this CPU's device kind, and remove it afterwards.
        kind = jax.devices()[0].device_kind
        tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(
            tpu_info.ChipVersion.TPU_V6E, 1
        )
        try:
            text = jax.export.export(step, platforms=["tpu"])(
                *args, block_sizes=BlockSizes(), **static
            ).mlir_module()
        finally:
            del tpu_info.registry[kind]
            jax.clear_caches()
        assert "tpu_custom_call" in text
    else:
        lowered = step.trace(*args, block_sizes=GpuBlockSizes(), **static)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
    assert "shard_map" in text or "manual" in text.lower()  # the kernel runs per shard
