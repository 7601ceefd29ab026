"""Where the int8 precision goes wrong on a GPU (gpu_checks.py measured 1.76 in logprob there
against 0.019 on a CPU): each piece of `models/int8.py` on the GPU against the same piece on the
host's CPU device or numpy, on random data at SmolLM2's and Qwen3-0.6B's matmul shapes.

    python benchmarks/gpu_int8_checks.py        # on a GPU host

Prints, per piece, its largest difference: the int8 x int8 -> int32 dot (exact: must be 0;
also with a batch axis, as the decoder calls it), `quantize_rows`, the whole `int8.dot`, and the
order in which `report`'s ordered callbacks arrive from a scan over layers. Then on a tiny random
checkpoint (tests/hf_reference.py): the calibration pass's outlier channels on each device, and
the int8 model's final hidden states on each (the same int8 weights), against float32's.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from tpuscore import Scorer  # noqa: E402
from tpuscore.models import decoder, int8, model  # noqa: E402
from tpuscore.models.attention import attend  # noqa: E402

SHAPES = [(46, 576, 1536), (46, 1536, 576), (7, 64, 128), (512, 1024, 3072), (300, 2048, 1024)]


def main() -> None:
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]  # on a CPU host: both the CPU
    print(f"jax {jax.__version__}; {gpu.device_kind} against the host CPU")
    rng = np.random.default_rng(0)
    for tokens, n_in, n_out in SHAPES:
        xq = rng.integers(-127, 128, (tokens, n_in), dtype=np.int8)
        wq = rng.integers(-127, 128, (n_in, n_out), dtype=np.int8)
        exact = xq.astype(np.int64) @ wq.astype(np.int64)
        on_gpu = jnp.dot(
            jax.device_put(xq, gpu), jax.device_put(wq, gpu), preferred_element_type=jnp.int32
        )
        dot_diff = int(np.abs(np.asarray(on_gpu, np.int64) - exact).max())

        x = rng.standard_normal((tokens, n_in)).astype(np.float32)
        x[:, :4] *= 300.0  # a few massive channels, as in SmolLM2
        w = (0.02 * rng.standard_normal((1, n_in, n_out))).astype(np.float32)
        weight = int8.quantize(w, 1, np.arange(4)[None])
        layer = int8.Int8Weight(
            weight.q[0], weight.scale[0], weight.channels[0], weight.outliers[0]
        )
        outlier = jnp.zeros(n_in, bool).at[layer.channels].set(True)
        results = []
        for device in (gpu, cpu):
            xd, ld = jax.device_put((x, layer), device)
            q, step = jax.jit(int8.quantize_rows)(xd, jax.device_put(outlier, device))
            y = jax.jit(int8.dot)(xd, ld)
            results.append((np.asarray(q), np.asarray(step), np.asarray(y)))
        (qg, sg, yg), (qc, sc, yc) = results
        print(
            f"[{tokens}, {n_in}] @ [{n_in}, {n_out}]: int8 dot |gpu - exact| {dot_diff}; "
            f"quantize_rows q {int(np.abs(qg.astype(int) - qc).max())}, step "
            f"{float(np.abs(sg - sc).max()):.2e}; int8.dot |gpu - cpu| "
            f"{float(np.abs(yg - yc).max()):.3e} (|y| max {float(np.abs(yc).max()):.2f})"
        )

    xq = rng.integers(-127, 128, (2, 37, 576), dtype=np.int8)
    wq = rng.integers(-127, 128, (576, 1536), dtype=np.int8)
    exact = np.einsum("btd,df->btf", xq.astype(np.int64), wq.astype(np.int64))
    batched = jnp.dot(
        jax.device_put(xq, gpu), jax.device_put(wq, gpu), preferred_element_type=jnp.int32
    )
    worst = int(np.abs(np.asarray(batched, np.int64) - exact).max())
    print(f"[2, 37, 576] @ [576, 1536]: int8 dot |gpu - exact| {worst}")
    model_checks(gpu, cpu)

    seen = []
    probes = int8.Probe(jnp.ones((4, 8, 8)), lambda values: seen.append(float(values.max())))

    def layer_step(x, w):
        int8.report("td,dk->tk", x, int8.Probe(w, probes.seen))
        return x + 1.0, None

    jax.jit(lambda x, w: jax.lax.scan(layer_step, x, w)[0])(jnp.zeros((3, 8)), probes.w)
    jax.effects_barrier()
    print(f"report's ordered callbacks from a 4-layer scan: {seen} (expected [0.0, 1.0, 2.0, 3.0])")


def model_checks(gpu, cpu) -> None:
    from hf_reference import make_checkpoint

    path = make_checkpoint(pathlib.Path(tempfile.mkdtemp()), "llama_gqa_untied", seed=3)
    base = Scorer.from_pretrained(path, dtype="float32")
    config = base.config
    params = jax.tree.map(np.asarray, base.engine.model.weights)
    amax = []
    for device in (gpu, cpu):
        with jax.default_device(device):
            amax.append(model._input_amax(config, params))
    a, b = amax
    for name in sorted(a):
        k = min(model.OUTLIER_CHANNELS, a[name].shape[1] // 8)
        pick = [
            np.sort(np.argsort(-x, axis=1, kind="stable")[:, :k], axis=1)
            for x in (a[name], b[name])
        ]
        rel = float(np.abs(a[name] - b[name]).max() / np.abs(b[name]).max())
        print(
            f"calibration {name}: amax rel diff {rel:.2e}; channels equal {np.array_equal(*pick)}"
        )
    with jax.default_device(cpu):
        weights = model._int8(config, params)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (1, 40)).astype(np.int32)
    positions = np.arange(40, dtype=np.int32)[None]
    causal = np.tril(np.ones((1, 40, 40), bool))

    def hidden(p, device):
        p, t, pos, mask = jax.device_put((p, tokens, positions, causal), device)
        attention = lambda q, k, v, layer: attend(q, k, v, mask, layer)  # noqa: E731
        return np.asarray(
            jax.jit(lambda p, t, pos: decoder.forward(p, config, t, pos, attention))(p, t, pos)
        )

    on_gpu, on_cpu, f32 = hidden(weights, gpu), hidden(weights, cpu), hidden(params, cpu)
    print(
        f"int8 model, final hidden: |gpu - cpu| {np.abs(on_gpu - on_cpu).max():.3e}; "
        f"|cpu - float32| {np.abs(on_cpu - f32).max():.3e}; |gpu - float32| "
        f"{np.abs(on_gpu - f32).max():.3e} (|float32| max {np.abs(f32).max():.2f})"
    )


if __name__ == "__main__":
    main()
