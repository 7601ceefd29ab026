"""The last layer at the read positions only (`read` in `decoder.forward` and `decoder.extend`):
the hidden states read equal the full pass's at those positions, and the last layer's output
projection and MLP run on the read rows alone. End-to-end parity with transformers is in
test_parity_hf.py, test_gemma.py and test_prefill_extend.py, whose backends all read this way."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_tokens
from tpuscore.models import decoder

# Gemma 3's last layer slides (window 9, shorter than the rows): the read rows keep their window.
CASES = ["qwen3_qknorm", "gemma3_window"]
B, T, QUERY = 3, 12, 21


def _assert_close(got, want):
    """Equal up to float32 rounding: the read rows' matmuls run at another shape than the full
    pass's, so their sums may round apart, by 1e-5 of the hidden state's scale at most."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def _causal():
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


def _forward(config, params, tokens, read):
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def attention(q, k, v, layer, read):
        window = decoder.within_window(positions, positions, layer.window)
        return decoder.attend(q, k, v, _causal() & window, layer, read)

    return decoder.forward(params, config, tokens, positions, attention, read)


def _prefix(scorer, rng):
    """The K/V of a random query of QUERY tokens, as prefill_extend caches it."""
    query = random_tokens(rng, QUERY, scorer.config.vocab_size)
    scorer.score(query, [[1]], [1], backend="prefill_extend")
    return scorer.get_backend("prefill_extend").cache.lookup(np.asarray(query, np.int32)).value


@pytest.mark.parametrize("case", CASES)
def test_read_rows_equal_the_full_pass_at_those_rows(case, scorers, rng):
    scorer = scorers(case)
    config, params = scorer.config, scorer.params
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
    read = jnp.asarray(rng.integers(0, T, (B, 2)), jnp.int32)
    full = jax.jit(_forward, static_argnums=0)(config, params, tokens, None)
    got = jax.jit(_forward, static_argnums=0)(config, params, tokens, read)
    _assert_close(got, decoder.rows_at(full, read))

    prefix = _prefix(scorer, rng)
    one = read[:, 0]

    @functools.partial(jax.jit, static_argnames="stacked")
    def extend(prefix, read, stacked):
        if stacked:  # each row its own prefix, gathered per row (mixed-query steps)
            stack = decoder.stack_prefixes([prefix, prefix], 2)
            rows = jnp.asarray([0, 1, 0])
            return decoder.extend(params, config, stack, tokens, _causal(), rows=rows, read=read)
        return decoder.extend(params, config, prefix, tokens, _causal(), read=read)

    for stacked in (False, True):
        full, _ = extend(prefix, None, stacked)
        got, _ = extend(prefix, one, stacked)
        _assert_close(got, full[jnp.arange(B), one])


def _top_level_dots(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of the dot_generals outside any loop: the last layer's and the head's."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(tuple(eqn.outvars[0].aval.shape))
        elif eqn.primitive.name not in ("scan", "while"):
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        shapes += _top_level_dots(getattr(sub, "jaxpr", sub))
    return shapes


def test_the_last_layer_runs_its_mlp_on_the_read_rows_only(scorers, rng):
    """Outside the layer scan, every dot with the MLP's width F has the read rows' shape: the
    other rows' MLP never runs. Without read, no layer's dot is outside the scan."""
    scorer = scorers("qwen3_qknorm")
    config, params = scorer.config, scorer.params
    F = config.intermediate_size
    tokens = jnp.zeros((B, T), jnp.int32)
    read = jnp.zeros((B, 1), jnp.int32)
    L, K, H, P = config.num_layers, config.num_kv_heads, config.head_dim, 16
    prefix = decoder.Prefix(
        k=jnp.zeros((L, K, H, P)), v=jnp.zeros((L, K, P, H)), length=jnp.int32(5),
        last_hidden=jnp.zeros(config.hidden_size),
    )  # fmt: skip

    def extend(read):  # one read position per row: [B]
        one = None if read is None else read[:, 0]
        return decoder.extend(params, config, prefix, tokens, _causal(), read=one)

    for run, args in [(_forward, (config, params, tokens)), (extend, ())]:
        static = (0,) if run is _forward else ()
        traced = jax.make_jaxpr(run, static_argnums=static)(*args, read)
        widths = [shape for shape in _top_level_dots(traced.jaxpr) if F in shape]
        assert widths and all(shape == (B, 1, F) for shape in widths), (run, widths)
        traced = jax.make_jaxpr(run, static_argnums=static)(*args, None)
        assert _top_level_dots(traced.jaxpr) == [], run
