"""The last layer at the read positions only, against the full last layer, in one process.

prefill_extend's extend step reads one position per item (its last token): the last layer
computes every token's K/V but its attention output, projection and MLP at that position alone
(`read` in `decoder.extend`). The other variant is the step as it was: the full last layer, then
the read positions gathered. Both are jitted side by side on the embedded default model and
timed alternately (the order flips each round), each call with fresh random items after a query
whose K/V is cached.

    python benchmarks/last_layer.py --query-tokens 300,2000 --rounds 8

Prints per query length the medians, the median of the per-round ratios (full / read) and the
largest score difference between the two.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore import Scorer
from tpuscore.backends.prefill_extend import backend as prefill_extend
from tpuscore.models import decoder


@functools.partial(jax.jit, static_argnames="config")
def full_last_layer(params, prefix, items, item_lens, label_ids, config):
    """`prefill_extend.score_items` with every position through the last layer."""
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    blocks = prefill_extend.key_blocks(prefix.k.shape[-1])
    hidden, _ = decoder.extend(params, config, prefix, items, causal, prefix_blocks=blocks)
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    return decoder.label_logprobs(params, config, last, label_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query-tokens", default="300,2000")
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--item-tokens", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, jax {jax.__version__} on {jax.devices()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    scorer = Scorer.from_pretrained(dtype=args.dtype)
    config, params = scorer.config, scorer.engine.model.params
    cache = scorer.get_backend("prefill_extend").cache
    rng = np.random.default_rng(0)
    rows, length = args.items, args.item_tokens
    lens, labels = jnp.full((rows,), length, jnp.int32), jnp.asarray([1, 2])
    variants = {"read rows": prefill_extend.score_items, "full last layer": full_last_layer}
    print(f"{rows} items x {length} tokens per extend step, {args.dtype}")
    print("| query tokens | read rows (s) | full last layer (s) | median ratio | max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for query_len in map(int, args.query_tokens.split(",")):
        query = rng.integers(100, config.vocab_size, query_len).tolist()
        scorer.score(query, [[1]], [1], backend="prefill_extend")
        prefix = cache.lookup(np.asarray(query, np.int32)).value

        def items():
            return jnp.asarray(rng.integers(100, config.vocab_size, (rows, length)), jnp.int32)

        first = items()
        got = [step(params, prefix, first, lens, labels, config) for step in variants.values()]
        diff = float(jnp.abs(got[0] - got[1]).max())
        times = {name: [] for name in variants}
        for round_ in range(args.rounds):
            for name in list(variants)[:: 1 if round_ % 2 == 0 else -1]:
                batch = items()
                start = time.perf_counter()
                jax.block_until_ready(variants[name](params, prefix, batch, lens, labels, config))
                times[name].append(time.perf_counter() - start)
        read, full = times["read rows"], times["full last layer"]
        ratio = statistics.median(f / r for f, r in zip(full, read, strict=True))
        print(f"| {query_len} | {statistics.median(read):.3f} | {statistics.median(full):.3f} |"
              f" {ratio:.3f}x | {diff:.2e} |", flush=True)  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
