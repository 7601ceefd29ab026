"""The fused CPU attention kernel (kernels/cpu_attention): rows attending to one shared prefix,
against its jnp reference `attention._prefix_parts` on fresh random inputs, batch invariance in
bits, the keys it reads, and prefill_extend running it. It needs an x86-64 CPU with AVX-512F and
a C++ compiler; elsewhere the package runs XLA's ops instead and these tests skip. Where the
platform can run it, a kernel that does not build or load fails them: in CI, and on any x86-64
Linux machine with AVX-512F and a compiler (`needs_kernel`)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_seed
from tpuscore.backends.prefill_extend import steps as prefill_extend
from tpuscore.kernels import cpu_attention
from tpuscore.models import attention, decoder


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def cannot_run() -> str | None:
    """Why this platform cannot run the kernel, or None where it can. In CI only the hardware
    excuses a skip: a missing compiler or a kernel turned off there is a failure."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, not {sys.platform} on {platform.machine()}"
    if "avx512f" not in _cpu_flags():
        return "this CPU has no AVX-512F"
    if _in_ci():
        return None
    if cpu_attention.library.compiler() is None:
        return "no C++ compiler ($CXX, c++, g++ or clang++)"
    if os.environ.get(cpu_attention.library.ENV, "").strip().lower() in ("off", "0", "false"):
        return f"turned off by {cpu_attention.library.ENV}"
    return None


@pytest.fixture(scope="module")
def built_kernel():
    """Skip where the platform cannot run the kernel; fail where it can but the kernel is not
    available (it did not build or load: the warning logged above says why)."""
    reason = cannot_run()
    if reason is not None:
        pytest.skip(reason)
    if not cpu_attention.available():
        pytest.fail(
            "this machine can run the CPU attention kernel (x86-64 Linux, AVX-512F, "
            f"compiler {cpu_attention.library.compiler()!r}) but it is not available: it did not "
            "build, load or register (see the logged warning)"
        )


needs_kernel = pytest.mark.usefixtures("built_kernel")
SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _inputs(rng, B, T, K, G, H, P):
    q = rng.standard_normal((B, T, K * G, H)).astype(np.float32)
    k = rng.standard_normal((K, H, P)).astype(np.float32)
    v = rng.standard_normal((K, P, H)).astype(np.float32)
    return q, k, v


def _example_rng(data) -> np.random.Generator:
    """Fresh inputs per run (the run's seed), the same on hypothesis' replay of an example."""
    return np.random.default_rng([run_seed(), data.draw(st.integers(0, 2**32 - 1), label="seed")])


kernel = jax.jit(cpu_attention.prefix_attention, static_argnames="scale")


@functools.partial(jax.jit, static_argnames="scale")
def reference(q, k, v, length, scale):
    layer = attention.LayerAttention(window=None, scale=scale, softcap=None)
    return attention._prefix_parts(q, k, v, jnp.arange(k.shape[-1]) < length, layer)


@needs_kernel
@SETTINGS
@given(
    data=st.data(),
    B=st.integers(1, 3),
    T=st.integers(1, 40),
    K=st.integers(1, 3),
    G=st.integers(1, 4),
    H=st.sampled_from([8, 10, 16, 22, 64, 80, 128]),
    P=st.integers(1, 300),
)
def test_matches_the_jnp_reference(data, B, T, K, G, H, P):
    """Against the exact result (numpy, float64), the kernel and XLA's ops
    (`attention._prefix_parts`) are both within 1e-5 (relative, or absolute below 1) in the
    outputs, the max and the exp sum: float32 rounding over dot products of up to 128 terms and
    sums of up to 300 keys, in other orders (the kernel scales q before q.k, XLA the scores
    after), reaches about 4e-6 in either."""
    length = data.draw(st.integers(1, P), label="length")
    scale = data.draw(st.sampled_from([H**-0.5, 0.3]), label="scale")
    q, k, v = _inputs(_example_rng(data), B, T, K, G, H, P)
    o, m, total = kernel(q, k, v, jnp.int32(length), scale=scale)
    ro, rm, rtotal = reference(q, k, v, jnp.int32(length), scale=scale)
    eo, em, etotal = _exact(q, k, v, length, scale)
    for got, xla, exact in ((o / total, ro / rtotal, eo), (m, rm, em), (total, rtotal, etotal)):
        for result in (got, xla):
            error = np.abs(np.asarray(result, np.float64) - exact) / np.maximum(np.abs(exact), 1)
            assert error.max() <= 1e-5


@needs_kernel
def test_the_softmax_is_accurate_to_a_few_ulps(rng):
    """Scores exact in float32 (q in {-1, 0, 1}, k in quarters, scale 1) and 16 keys, one
    16-lane vector: what is left is the kernel's exp and one lane sum, so the max equals the
    exact one and the exp sum and outputs are within 1e-6 of it (a few ulps; an exp constant off
    by 1e-5 moves them by 6e-6)."""
    K, G, H, P = 2, 2, 16, 16
    q = rng.integers(-1, 2, (1, 20, K * G, H)).astype(np.float32)
    k = (rng.integers(-4, 5, (K, H, P)) / 4).astype(np.float32)
    v = rng.uniform(-1, 1, (K, P, H)).astype(np.float32)
    o, m, total = kernel(q, k, v, jnp.int32(P), scale=1.0)
    eo, em, etotal = _exact(q, k, v, P, 1.0)
    np.testing.assert_array_equal(m, em)
    np.testing.assert_allclose(total, etotal, rtol=1e-6, atol=0)
    np.testing.assert_allclose(o / total, eo, rtol=0, atol=1e-6)


def _exact(q, k, v, length, scale):
    """The attention parts in float64: o (normalized) [B,T,K,G,H], max and exp sum [B,T,K,G,1]."""
    B, T, N, H = q.shape
    K = k.shape[0]
    q = q.astype(np.float64).reshape(B, T, K, N // K, H)
    scores = np.einsum("btkgh,khp->btkgp", q, k[..., :length].astype(np.float64)) * scale
    m = scores.max(-1, keepdims=True)
    e = np.exp(scores - m)
    total = e.sum(-1, keepdims=True)
    o = np.einsum("btkgp,kph->btkgh", e, v[:, :length].astype(np.float64)) / total
    return o, m, total


@needs_kernel
def test_no_key_gives_an_empty_part(rng):
    """Length 0: what `_masked_exp` gives a fully masked row (o 0, max finfo.min, sum 0), which
    `attention._merge_parts` weighs as nothing."""
    q, k, v = _inputs(rng, 1, 5, 2, 2, 16, 32)
    o, m, total = kernel(q, k, v, jnp.int32(0), scale=0.25)
    assert not np.asarray(o).any() and not np.asarray(total).any()
    assert (np.asarray(m) == np.finfo(np.float32).min).all()


@needs_kernel
@SETTINGS
@given(data=st.data(), T=st.integers(2, 120), H=st.sampled_from([10, 64]))
def test_a_row_is_bit_identical_whatever_shares_its_call(data, T, H):
    """Row r of a call of T rows equals, in bits, the same row in a call of other rows (other
    counts, positions and batch splits): no row's arithmetic depends on its block."""
    K, G, P, length = 2, 3, 200, 150
    rng = _example_rng(data)
    q, k, v = _inputs(rng, 1, T, K, G, H, P)
    r = data.draw(st.integers(0, T - 1), label="row")
    others = data.draw(st.integers(0, 100), label="others")
    companions = rng.standard_normal((1, others, K * G, H)).astype(np.float32)
    at = data.draw(st.integers(0, others), label="at")
    mixed = np.concatenate([companions[:, :at], q[:, r : r + 1], companions[:, at:]], axis=1)
    alone = kernel(q, k, v, jnp.int32(length), scale=0.125)
    among = kernel(mixed, k, v, jnp.int32(length), scale=0.125)
    for a, b in zip(alone, among, strict=True):
        a, b = np.asarray(a)[:, r], np.asarray(b)[:, at]
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_kernel
def test_keys_past_length_are_never_read(rng):
    """NaN in every key and value position from `length` on leaves the result finite and equal
    to the clean one: the padding a prefix's bucket adds is neither read into a sum nor
    multiplied."""
    K, G, H, P, length = 2, 2, 64, 256, 70
    q, k, v = _inputs(rng, 2, 9, K, G, H, P)
    clean = kernel(q, k, v, jnp.int32(length), scale=0.125)
    k[..., length:], v[:, length:] = np.nan, np.nan
    poisoned = kernel(q, k, v, jnp.int32(length), scale=0.125)
    for a, b in zip(clean, poisoned, strict=True):
        assert np.isfinite(np.asarray(b)).all()
        np.testing.assert_array_equal(a, b)


@needs_kernel
def test_prefill_extend_runs_it_and_matches_xla_ops(scorers, rng, monkeypatch):
    """prefill_extend's extend step calls the kernel on a float32 model without windows, and its
    scores equal the same step on XLA's ops within float rounding."""
    scorer = scorers("llama_gqa_untied")
    config = scorer.config
    P, length = 64, 41
    shape = (config.num_layers, config.num_kv_heads, config.head_dim, P)
    prefix = decoder.Prefix(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape).swapaxes(2, 3), jnp.float32),
        length=jnp.int32(length),
        last_hidden=jnp.zeros(config.hidden_size, jnp.float32),
    )
    items = jnp.asarray(rng.integers(0, config.vocab_size, (3, 6)), jnp.int32)
    args = (scorer.params, prefix, items, jnp.asarray([6, 4, 1]), jnp.asarray([1, 2]), config)
    lowered = prefill_extend.score_items.lower(*args).as_text()
    assert cpu_attention.library.PREFIX_TARGET in lowered
    fused = np.asarray(prefill_extend.score_items(*args))
    monkeypatch.setattr(prefill_extend, "prefix_kernel", lambda: None)
    jax.clear_caches()
    try:
        lowered = prefill_extend.score_items.lower(*args).as_text()
        assert cpu_attention.library.PREFIX_TARGET not in lowered
        plain = np.asarray(prefill_extend.score_items(*args))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    np.testing.assert_allclose(fused, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "env, logged",
    [({"TPUSCORE_CPU_KERNELS": "off"}, ""), ({"CXX": "false"}, "did not build")],
)
def test_off_or_unbuildable_means_xla_ops(tmp_path, env, logged):
    """Turned off, or with a compiler that fails (into an empty cache), the kernel is not
    available, with a warning for the failed build; callers then keep XLA's ops."""
    code = (
        "import logging; logging.basicConfig()\n"
        "from tpuscore.kernels import cpu_attention\n"
        "print('available', cpu_attention.available())\n"
    )
    environ = {**os.environ, "TPUSCORE_KERNEL_CACHE": str(tmp_path), **env}
    run = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "available False" in run.stdout
    assert logged in run.stderr


def test_a_kernel_that_does_not_build_fails_these_tests_where_it_could_run(tmp_path):
    """Where the platform can run the kernel, a compiler that fails (into an empty cache) makes
    the kernel's tests fail, not skip: CI on an AVX-512 machine cannot pass without it."""
    reason = cannot_run()
    if reason is not None:
        pytest.skip(reason)
    environ = {**os.environ, "TPUSCORE_KERNEL_CACHE": str(tmp_path), "CXX": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-k", "test_no_key_gives_an_empty_part",
         "-n", "0", "-p", "no:cacheprovider", "-q"],
        env=environ, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 error" in run.stdout and "skipped" not in run.stdout, run.stdout
    assert "it is not available: it did not build" in run.stdout
