"""Would a static set of outlier channels close mixed precision's gap? An emulation, on the
default model: the serial backend in float32 with the bfloat16 roundings of "mixed" applied per
matmul input (the projection and MLP matmuls' activations and weights), except for the k input
channels of each layer and matmul input with the largest |activation| over a fixed calibration
prompt (not the evaluated requests), which stay float32 (their weight rows too, with
--weights-f32). A static set is batch-invariant; a per-row one is not.

    python benchmarks/precision_outliers.py [--ks 0,4,16,32,64] [--random 5]

Prints the worst and mean gap (max |logprob - float32 logprob| per request) on the text requests
and the random-token requests of `precision_gap.py`. A study, not a product path: it patches the
decoder's `_dot` and `_scan_layers` in this process.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from precision_gap import gaps, text_requests

from tpuscore import Scorer
from tpuscore.models import decoder

f32, bf16 = jnp.float32, jnp.bfloat16
# The matmul inputs mixed rounds, by the einsum each is used in: q/k/v, o, gate/up, down.
INPUT_OF = {
    "btd,dnh->btnh": "attn", "btd,dkh->btkh": "attn", "btnh,nhd->btd": "o",
    "btd,df->btf": "mlp", "btf,fd->btd": "down",
}  # fmt: skip
CALIBRATION = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers."
    "\nQ: What is two plus two?\nA: Four.\n<|im_start|>user\nHello!<|im_end|>\n"
    "<|im_start|>assistant\nHi there."
)


class Emulation:
    """Patches the decoder: mode "exact" (float32), "calibrate" (record each layer's per-channel
    max |input|) or "mixed" (round as mixed does, but for the `keep` channels)."""

    def __init__(self):
        self.mode, self.weights_f32, self.layer = "exact", False, None
        self.stats: dict[tuple[int, str], np.ndarray] = {}
        self.keep: dict[str, jax.Array] = {}
        self.dot, self.scan = decoder._dot, decoder._scan_layers
        decoder._dot, decoder._scan_layers = self._dot, self._scan

    def _record(self, layer, name, amax):
        key = (int(layer), name)
        self.stats[key] = np.maximum(self.stats.get(key, 0), np.asarray(amax))

    def _dot(self, spec, x, w):
        name = INPUT_OF.get(spec)
        if name is None or self.mode == "exact":
            return self.dot(spec, x, w)
        flat = x.reshape(*x.shape[: x.ndim - (2 if name == "o" else 1)], -1)
        if self.mode == "calibrate":
            amax = jnp.max(jnp.abs(flat), axis=tuple(range(flat.ndim - 1)))
            jax.debug.callback(self._record, self.layer, name, amax)
            return self.dot(spec, x, w)
        keep = self.keep[name][self.layer]
        rows = w.reshape(-1, w.shape[-1]) if name == "o" else w.reshape(w.shape[0], -1)
        keep_rows = keep[:, None] if self.weights_f32 else jnp.zeros_like(keep)[:, None]
        x = jnp.where(keep, flat, flat.astype(bf16).astype(f32)).reshape(x.shape)
        w = jnp.where(keep_rows, rows, rows.astype(bf16).astype(f32)).reshape(w.shape)
        return jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)

    def _scan(self, step, x, layers, *per_layer):
        def numbered(x, inputs):
            *inputs, self.layer = inputs
            return step(x, tuple(inputs))

        count = jax.tree.leaves(layers)[0].shape[0]
        return self.scan(numbered, x, layers, *per_layer, jnp.arange(count))

    def keep_largest(self, k: int) -> None:
        layers = 1 + max(layer for layer, _ in self.stats)
        for name in set(INPUT_OF.values()):
            masks = np.zeros((layers, self.stats[(0, name)].size), bool)
            for layer in range(layers):
                masks[layer, np.argsort(self.stats[(layer, name)])[masks.shape[1] - k :]] = True
            self.keep[name] = jnp.asarray(masks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="0,4,16,32,64", help="channels kept per matmul input")
    parser.add_argument("--random", type=int, default=5, help="random-token queries")
    args = parser.parse_args()
    emulation = Emulation()
    scorer = Scorer.from_pretrained(dtype="float32")
    vocab = scorer.config.vocab_size
    rng = np.random.default_rng(0)  # the same random requests as precision_gap.py
    suites = {
        "text": [(q, items, {"labels": labels}) for q, items, labels in text_requests()],
        "random": [
            (
                rng.integers(0, vocab, 300).tolist(),
                [rng.integers(0, vocab, 10).tolist() for _ in range(8)],
                {"label_token_ids": rng.choice(vocab, 3, replace=False).tolist()},
            )
            for _ in range(args.random)
        ],
    }

    def scores(requests):
        jax.clear_caches()  # the patched steps retrace
        return [scorer.score(q, it, backend="serial", **lab).logprobs for q, it, lab in requests]

    exact = {suite: scores(requests) for suite, requests in suites.items()}
    emulation.mode = "calibrate"
    other = np.random.default_rng(12345)
    scorer.score(CALIBRATION, [" Yes.", " No, thanks."], labels=[" yes"], backend="serial")
    random_calibration = [other.integers(0, vocab, 10).tolist() for _ in range(4)]
    scorer.score(other.integers(0, vocab, 200).tolist(), random_calibration, [1], backend="serial")
    jax.effects_barrier()
    emulation.mode = "mixed"
    print("| kept channels | their weights | text worst (mean) | random worst (mean) | random |")
    print("| ---: | --- | ---: | ---: | --- |")
    for k in map(int, args.ks.split(",")):
        emulation.keep_largest(k)
        for emulation.weights_f32 in (True, False) if k else (False,):
            got = {s: [gaps(e, g)[0] for e, g in zip(exact[s], scores(r), strict=True)]
                   for s, r in suites.items()}  # fmt: skip
            text, rand = np.array(got["text"]), np.array(got["random"])
            weights = "float32" if emulation.weights_f32 else "bfloat16"
            print(f"| {k} | {weights} | {text.max():.3f} ({text.mean():.3f}) |"
                  f" {rand.max():.3f} ({rand.mean():.3f}) | {np.round(rand, 3).tolist()} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
