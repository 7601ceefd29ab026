"""The fused CPU segment kernel (`cpu_attention.segment_attention`): packed rows under the
shared-prefix segment mask, against the jnp reference `segment_attention_reference` on fresh
random layouts (windows, GQA, head dims and lengths the kernel's panels do not divide), its
bfloat16 dots against the same arithmetic in jnp (`bf16_reference`), an item's output
independent in bits of the other items' contents, and packed_segment running it on CPU. Skips
where the platform cannot run the kernel, as test_cpu_attention.py does; the bfloat16 dots'
tests where the CPU has no AVX-512 BF16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_cpu_attention import cannot_run
from tpuscore import Scorer
from tpuscore.backends.packed import steps as packed_steps
from tpuscore.kernels import cpu_attention
from tpuscore.kernels.cpu_attention import CpuTiles
from tpuscore.kernels.segment.mask import segment_attention_reference, segment_mask

pytestmark = pytest.mark.skipif(cannot_run() is not None, reason=str(cannot_run()))

kernel = jax.jit(cpu_attention.segment_attention, static_argnames=("scale", "softcap", "bf16"))
needs_bf16_dots = pytest.mark.skipif(
    cannot_run() is None and not cpu_attention.bf16_dots(), reason="this CPU has no AVX-512 BF16"
)


def packed_layout(rng, T: int) -> tuple[int, np.ndarray, list[tuple[int, int]]]:
    """A random packed row of T tokens: (prefix_len, seg_start [T], the items' [start, stop))."""
    prefix_len = int(rng.integers(0, T))
    seg_start, items, at = np.zeros(T, np.int32), [], prefix_len
    while at < T and rng.random() < 0.9:
        n = int(min(T - at, rng.integers(1, max(2, (T - at) // 2 + 1))))
        seg_start[at : at + n] = at
        items.append((at, at + n))
        at += n
    seg_start[at:] = np.arange(at, T)  # padding rows: each its own segment
    return prefix_len, seg_start, items


def reference(q, k, v, prefix_len, seg_start, window, scale):
    """`segment_attention_reference` in the kernel's token-major layout."""
    heads_first = [x.swapaxes(1, 2) for x in (q, k, v)]
    out = segment_attention_reference(*heads_first, prefix_len, seg_start, window, scale=scale)
    return out.swapaxes(1, 2)


def random_case(rng, windowed: bool):
    """Fresh random inputs (q, k, v, prefix_len, seg_start, window, scale): GQA or not, head dims
    24/64/128, lengths not all multiples of the 32-key panels, a random window where asked."""
    B, K, G = int(rng.integers(1, 3)), int(rng.choice([1, 2])), int(rng.choice([1, 3]))
    H = int(rng.choice([24, 64, 128]))
    T = int(rng.choice([16, 100, 130, 272]))  # not all multiples of the 32-key panels
    layouts = [packed_layout(rng, T) for _ in range(B)]
    prefix_len = jnp.asarray([p for p, _, _ in layouts], jnp.int32)
    seg_start = jnp.asarray(np.stack([s for _, s, _ in layouts]))
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (K * G, K, K))
    window = jnp.int32(int(rng.integers(1, 40))) if windowed else None
    scale = float(rng.uniform(0.05, 0.3))
    return q, k, v, prefix_len, seg_start, window, scale


def random_cases(count: int, in_ci: int) -> list:
    """Case numbers for a test on fresh random layouts: `in_ci` of them run in every run (each
    run draws its own layouts, from its seed), the rest with the slow tests."""
    return [c if c < in_ci else pytest.param(c, marks=pytest.mark.slow) for c in range(count)]


@pytest.mark.parametrize("case", random_cases(12, in_ci=6))
def test_it_equals_the_reference_on_random_layouts(case, rng):
    q, k, v, prefix_len, seg_start, window, scale = random_case(rng, windowed=bool(case % 2))
    got = kernel(q, k, v, prefix_len, seg_start, window, scale=scale)
    want = reference(q, k, v, prefix_len, seg_start, window, scale)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def bf16_reference(q, k, v, prefix_len, seg_start, window, scale):
    """The kernel's bfloat16 arithmetic in float32 ops, token-major: q, k, v and the softmax's
    numerator rounded to bfloat16; its sum, the max and every dot's sum in float32; the result
    rounded to bfloat16."""
    bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    B, T, N, H = q.shape
    K = k.shape[2]
    hp = jax.lax.Precision.HIGHEST
    qg = bf16(q).reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, bf16(k), precision=hp) * scale
    mask = segment_mask(prefix_len, seg_start, T, window)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    e = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    o = jnp.einsum("bkgts,bskh->btkgh", bf16(e), bf16(v), precision=hp)
    o = o / e.sum(axis=-1).transpose(0, 3, 1, 2)[..., None]
    return o.reshape(B, T, N, H).astype(jnp.bfloat16)


@needs_bf16_dots
@pytest.mark.parametrize("case", random_cases(8, in_ci=4))
def test_its_bfloat16_dots_equal_bfloat16_arithmetic_on_random_layouts(case, rng):
    """bf16: q, k, v and the softmax's numerator rounded to bfloat16, float32 sums: as
    `bf16_reference`, the same for bfloat16 inputs, near the float32 kernel."""
    q, k, v, prefix_len, seg_start, window, scale = random_case(rng, windowed=bool(case % 2))
    got = kernel(q, k, v, prefix_len, seg_start, window, scale=scale, bf16=True)
    assert got.dtype == jnp.bfloat16
    got, want = (
        np.asarray(x, np.float32)
        for x in (got, bf16_reference(q, k, v, prefix_len, seg_start, window, scale))
    )
    # The kernel's exp and XLA's differ in the last bits, which can round a weight to the
    # neighbouring bfloat16 in a few rows: that moves an output by at most 2**-8 of its value's
    # largest |v|, and the output's own rounding by a bfloat16 ulp; the others round alike.
    bound = 2**-8 * float(jnp.abs(v).max())
    np.testing.assert_allclose(got, want, atol=bound, rtol=2**-7)
    assert np.mean(np.abs(got - want) <= 2e-5 * np.abs(want)) > 0.99
    as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]  # bfloat16 inputs: the same dots
    np.testing.assert_array_equal(kernel(*as_bf16, prefix_len, seg_start, window, scale=scale), got)
    exact = kernel(q, k, v, prefix_len, seg_start, window, scale=scale)
    np.testing.assert_allclose(got, exact, atol=0.1, rtol=0)


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16_dots)])
def test_an_items_output_does_not_depend_on_the_other_items_in_bits(rng, bf16):
    T, K, G, H = 160, 2, 3, 64
    prefix_len, seg_start, items = 37, np.zeros(T, np.int32), [(37, 60), (60, 101), (101, 160)]
    for start, stop in items:
        seg_start[start:stop] = start
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, n, H)), jnp.float32) for n in (K * G, K, K))
    args = (jnp.asarray([prefix_len], jnp.int32), jnp.asarray(seg_start[None]), None)
    before = kernel(q, k, v, *args, scale=0.125, bf16=bf16)
    others = np.r_[60:160]  # the second and third items' tokens, rewritten
    noise = [jnp.asarray(rng.standard_normal(x[:, others].shape), jnp.float32) for x in (q, k, v)]
    q2, k2, v2 = (x.at[:, others].set(n) for x, n in zip((q, k, v), noise, strict=True))
    after = kernel(q2, k2, v2, *args, scale=0.125, bf16=bf16)
    np.testing.assert_array_equal(before[:, :60], after[:, :60])  # the query and the first item
    assert not np.array_equal(before[:, 60:], after[:, 60:])


def test_packed_segment_runs_it_on_cpu_and_scores_as_the_reference(checkpoint_dir, rng):
    scorer = Scorer.from_pretrained(checkpoint_dir("llama_gqa_untied"), dtype="float32")
    backend = scorer.get_backend("packed_segment")
    assert isinstance(backend.block_sizes, CpuTiles) and backend.interpret is False
    vocab = scorer.config.vocab_size
    query = rng.integers(0, vocab, 45).tolist()
    items = [rng.integers(0, vocab, int(rng.integers(1, 20))).tolist() for _ in range(7)]
    got = scorer.score(query, items, [3, 4], backend="packed_segment")
    want = scorer.score(query, items, [3, 4], backend="reference")
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
    config, T = scorer.config, 64
    tokens = jnp.zeros((1, T), jnp.int32)
    lowered = packed_steps.score_packed.lower(
        scorer.engine.model.params, tokens, tokens, jnp.zeros(1, jnp.int32), tokens,
        jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 2), jnp.int32), config=config,
        block_sizes=CpuTiles(), layout=scorer.engine.model.layout, interpret=False,
    ).as_text()  # fmt: skip
    assert cpu_attention.library.SEGMENT_TARGET in lowered


@needs_bf16_dots
@pytest.mark.parametrize("dtype", ["mixed", "bfloat16"])
def test_packed_segment_runs_its_bfloat16_dots_where_the_weights_are_bfloat16(
    checkpoint_dir, rng, dtype
):
    """mixed and bfloat16 attend through the kernel's bfloat16 dots (bfloat16 fell back to the
    dense mask before), near the same precision's packed_dense, whose attention XLA runs."""
    scorer = Scorer.from_pretrained(checkpoint_dir("llama_gqa_untied"), dtype=dtype)
    backend = scorer.get_backend("packed_segment")
    assert backend.block_sizes == CpuTiles(bf16=True) and not backend.dense_mask
    vocab = scorer.config.vocab_size
    query = rng.integers(0, vocab, 45).tolist()
    items = [rng.integers(0, vocab, int(rng.integers(1, 20))).tolist() for _ in range(7)]
    got = scorer.score(query, items, [3, 4], backend="packed_segment").logprobs
    dense = scorer.score(query, items, [3, 4], backend="packed_dense").logprobs
    np.testing.assert_allclose(got, dense, atol=0.05, rtol=0)
    T, model = 64, scorer.engine.model
    tokens = jnp.zeros((1, T), jnp.int32)
    lowered = packed_steps.score_packed.lower(
        model.params, tokens, tokens, jnp.zeros(1, jnp.int32), tokens,
        jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 2), jnp.int32), config=scorer.config,
        block_sizes=backend.block_sizes, layout=model.layout, interpret=False,
    ).as_text()  # fmt: skip
    assert cpu_attention.library.SEGMENT_TARGET in lowered and "bf16 = true" in lowered


def test_a_soft_cap_and_bfloat16_without_its_dots_keep_xlas_ops(monkeypatch):
    assert not cpu_attention.segment_kernel_applies(jnp.float32, 50.0)
    assert cpu_attention.segment_kernel_applies(jnp.float32, None)
    assert cpu_attention.segment_kernel_applies(jnp.bfloat16, None) == cpu_attention.bf16_dots()
    monkeypatch.setattr(cpu_attention, "bf16_dots", lambda: False)  # a CPU without AVX-512 BF16
    assert not cpu_attention.segment_kernel_applies(jnp.bfloat16, None)
    x = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.segment_attention(
            x, x[:, :, :1], x[:, :, :1], jnp.zeros(1, jnp.int32), jnp.zeros((1, 32), jnp.int32),
            None, None,
        )  # fmt: skip


def test_without_the_kernel_packed_segment_plans_and_attends_under_the_dense_mask(
    checkpoint_dir, rng, monkeypatch
):
    """Where the kernel cannot run (no AVX-512F, no compiler, TPUSCORE_CPU_KERNELS=off),
    packed_segment plans for the [T, T] mask and its step runs XLA's ops, still exact."""
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    scorer = Scorer.from_pretrained(checkpoint_dir("qwen2_bias"), dtype="float32")
    backend = scorer.get_backend("packed_segment")
    assert isinstance(backend.block_sizes, CpuTiles) and backend.dense_mask
    vocab = scorer.config.vocab_size
    query = rng.integers(0, vocab, 30).tolist()
    items = [rng.integers(0, vocab, int(rng.integers(1, 12))).tolist() for _ in range(5)]
    jax.clear_caches()  # no step traced with the kernel is reused
    try:
        got = scorer.score(query, items, [3, 4], backend="packed_segment")
        tokens = jnp.zeros((1, 64), jnp.int32)
        lowered = packed_steps.score_packed.lower(
            scorer.engine.model.params, tokens, tokens, jnp.zeros(1, jnp.int32), tokens,
            jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 2), jnp.int32), config=scorer.config,
            block_sizes=CpuTiles(), layout=scorer.engine.model.layout, interpret=False,
        ).as_text()  # fmt: skip
    finally:
        jax.clear_caches()  # nor is one traced without it
    assert cpu_attention.library.SEGMENT_TARGET not in lowered
    want = scorer.score(query, items, [3, 4], backend="reference")
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
