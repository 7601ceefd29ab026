"""Helpers shared by the tests (fixtures live in conftest.py)."""

import copy
import os
import zlib

import numpy as np

from tpuscore.backends import BackendOutput, PerGroupBackend, StepStats
from tpuscore.engine.executables import COMPILE_EVENT  # one name for the event
from tpuscore.models.config import ModelConfig

# Real models' shapes, for what needs no weights (lowering, cost estimates).
SMOLLM2_135M = ModelConfig(  # the default model's (test_default_model.py checks it)
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
QWEN3_0_6B = ModelConfig(
    family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
)  # fmt: skip
GEMMA2_2B = ModelConfig(  # google/gemma-2-2b's config.json, as ModelConfig.from_hf reads it
    family="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
    num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
    norm_offset=1.0, embed_scale=2304**0.5, query_pre_attn_scalar=256.0, sandwich_norms=True,
    attn_logit_softcap=50.0, final_logit_softcap=30.0, sliding_window=4096,
    local_layers=(True, False) * 13,
)  # fmt: skip


def compile_events() -> list[str]:
    """Clear JAX's caches and return a list that grows by one entry per XLA compilation.

    The event times `compile_or_get_cached`: with JAX's persistent compilation cache on, a load
    from it counts too (tests/test_warm_start.py tells the two apart)."""
    import jax
    from jax import monitoring

    events = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: events.append(event) if event == COMPILE_EVENT else None
    )
    jax.clear_caches()
    return events


# The decoder families the `case` fixture (conftest.py) runs a test on.
FAMILY_CASES = ("llama_gqa_untied", "llama3_rope_tied", "qwen2_bias", "qwen3_qknorm")
SEED_ENV = "TPUSCORE_TEST_SEED"


def run_seed() -> int:
    """The seed of this test run: `TPUSCORE_TEST_SEED` if set (to replay a run), else a fresh one
    drawn once and put in the environment, so pytest-xdist workers and the subprocesses tests
    start share it. conftest.py prints it in the header and in every failure's report."""
    if SEED_ENV not in os.environ:
        os.environ[SEED_ENV] = str(int.from_bytes(os.urandom(4), "little"))
    value = os.environ[SEED_ENV]
    if not value.isdigit():
        raise ValueError(f"{SEED_ENV}={value!r}: a seed is a non-negative integer")
    return int(value)


def seeded_rng(key: str) -> np.random.Generator:
    """Random inputs for `key` (a test's node id, a fixture's name): fresh each run, and the same
    for the same key whenever the run's seed is replayed, whatever order or worker runs it."""
    return np.random.default_rng([run_seed(), zlib.crc32(key.encode())])


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def fresh(scorer):
    """A scorer on the same model with its own backends, so an empty prefix cache: the session's
    shared scorers hold other tests' queries, and a partial prefix hit runs other steps (same
    scores within rounding, not bit for bit)."""
    shared = copy.copy(scorer)
    shared.engine = scorer.engine.fresh()
    return shared


class SpyBackend(PerGroupBackend):
    """A backend that counts its calls and scores zeros: what reaches a backend, and when."""

    calls = 0

    def __init__(self, model, options):
        pass

    def score(self, batch):
        SpyBackend.calls += 1
        shape = (batch.items.shape[0], batch.label_ids.shape[0])
        return BackendOutput(np.zeros(shape, np.float32), np.ones(shape[0], bool), StepStats())


class ServerThread:
    """uvicorn serving `app` from a thread on `host` (127.0.0.1), on a port the OS picked;
    stopped by `stop()`, which drains like SIGTERM does (uvicorn's should_exit)."""

    def __init__(
        self, app, *, timeout_graceful_shutdown: float | None = None, host: str = "127.0.0.1"
    ):
        import socket
        import threading

        import uvicorn

        ready = threading.Event()  # set once the server serves, or once it gave up starting

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                ready.set()

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=5,
            timeout_graceful_shutdown=timeout_graceful_shutdown,
        )
        self.server = Server(config)

        def serve():
            try:
                self.server.run(sockets=[sock])
            finally:
                ready.set()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        if not ready.wait(30) or not self.server.started:
            raise RuntimeError("the test server did not start (its log says why)")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the test server did not stop within 30 s"


def rss_mib() -> float:
    """This process's resident memory, MiB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# The default mode's documented bound on a request scored among others against alone
# (docs/batch-invariance.md, measured by benchmarks/alone_vs_batched.py on fresh random
# checkpoints): numpy's allclose, |batched - alone| <= atol + rtol * |alone|. Batch-invariant
# mode is bit-identical instead.
ALONE_VS_BATCHED = {"rtol": 1e-5, "atol": 5e-5}


def start_ray(**init_kwargs) -> None:
    """A local Ray cluster of 2 CPUs whose workers import this checkout's tpuscore on CPU,
    without the persistent compilation cache (workers would race on it)."""
    import ray

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {"PYTHONPATH": src, "JAX_PLATFORMS": "cpu", "TPUSCORE_COMPILATION_CACHE": "off"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, **init_kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = False
