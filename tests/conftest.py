import atexit
import os
import shutil
import tempfile
import zlib

# The `tpuscore` command caches compiles in the user cache directory by default: not from tests.
os.environ.setdefault("TPUSCORE_COMPILATION_CACHE", "off")
# One JAX compilation cache per test run, fresh and shared by the xdist workers and the
# subprocesses tests start (they inherit the environment): an executable another test already
# compiled loads in milliseconds instead of compiling again. Set before JAX is imported, which
# reads these variables then. helpers.compile_events counts a load as an executable, as it
# counts a compile, so compile-counting tests see the same numbers.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpuscore-tests-jax-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
# Likewise a directory the workers share for references that are slow to build.
SHARED_ENV = "TPUSCORE_TESTS_SHARED_DIR"
if SHARED_ENV not in os.environ:
    os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="tpuscore-tests-shared-")
    atexit.register(shutil.rmtree, os.environ[SHARED_ENV], ignore_errors=True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import FAMILY_CASES, SEED_ENV, run_seed, seeded_rng  # noqa: E402
from tpuscore import DefaultModelMissingError, Scorer  # noqa: E402
from tpuscore.models.loaders.default import default_model_path as find_default_model  # noqa: E402


def pytest_configure(config):
    """Fix the run's seed before any test or worker starts; an xdist worker takes its
    controller's."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        os.environ[SEED_ENV] = workerinput[SEED_ENV]
    try:
        run_seed()
    except ValueError as bad:
        raise pytest.UsageError(str(bad)) from None


def pytest_collection_modifyitems(config, items):
    """The quick loop (`-m "not slow and not extra_case"`) runs one case of each parametrized
    test, the one its name picks (so families and backends all get a turn across tests); its
    other cases are marked `extra_case`. CI runs every case."""
    cases: dict[tuple, list] = {}
    for item in items:
        if hasattr(item, "callspec"):
            cases.setdefault((item.path, item.originalname), []).append(item)
    for (_, name), group in cases.items():
        quick = zlib.crc32(name.encode()) % len(group)
        for index, item in enumerate(group):
            if index != quick:
                item.add_marker(pytest.mark.extra_case)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: hand the run's seed to each worker."""
    node.workerinput[SEED_ENV] = str(run_seed())


def pytest_report_header(config):
    return f"tpuscore test seed: {run_seed()} ({SEED_ENV}={run_seed()} replays this run)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the command that replays its random inputs."""
    report = yield
    if report.failed:
        replay = f"{SEED_ENV}={run_seed()} python -m pytest '{item.nodeid}'"
        report.sections.append(("tpuscore test seed", replay))
    return report


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """A function case -> directory of a tiny random HF checkpoint, built once per session."""
    from hf_reference import make_checkpoint

    built = {}

    def get(case: str):
        if case not in built:
            built[case] = make_checkpoint(tmp_path_factory.mktemp(case), case)
        return built[case]

    return get


@pytest.fixture(scope="session")
def scorers(checkpoint_dir):
    """A function case -> float32 Scorer on that checkpoint, built once per session."""
    built = {}

    def get(case: str) -> Scorer:
        if case not in built:
            built[case] = Scorer.from_pretrained(checkpoint_dir(case), dtype="float32")
        return built[case]

    return get


@pytest.fixture(params=FAMILY_CASES)
def case(request) -> str:
    return request.param


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs each run, drawn from the run's seed (a failure's report prints it)."""
    return seeded_rng(request.node.nodeid)


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded SmolLM2 GGUF. Tests that need it skip where it is not installed, but not in
    CI, where `nox -s tests` installs it: a skip there would hide the parity check."""
    try:
        path = find_default_model()
    except DefaultModelMissingError as missing:
        if os.environ.get("CI"):
            pytest.fail(str(missing))
        pytest.skip(str(missing))
    # Dequantized once per machine: the first worker here writes the weight cache's float32
    # entry, which later loads (the examples' subprocesses too) map instead of dequantizing.
    import filelock

    from tpuscore.models import loaders

    with filelock.FileLock(os.path.join(os.environ[SHARED_ENV], "weights.lock")):
        loaders.load(path, dtype=np.dtype(np.float32))
    return path


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' own load of the same GGUF (dequantized to float32): the reference. The
    first worker to load it saves it (safetensors, float32) for the others: transformers takes
    about 20 s to dequantize the GGUF, and a reload reads back the same tensors."""
    import filelock
    import torch
    import transformers

    saved = os.path.join(os.environ[SHARED_ENV], "hf_default_model")
    with filelock.FileLock(saved + ".lock"):
        if not os.path.exists(saved):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
            )
            # save_pretrained refuses a model loaded from GGUF: its config and tensors instead
            # (a tied lm_head is the embedding, and is tied again on load).
            import safetensors.torch

            partial = saved + ".partial"
            model.config.save_pretrained(partial)
            tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                tensors.pop("lm_head.weight", None)
            safetensors.torch.save_file(tensors, os.path.join(partial, "model.safetensors"))
            os.rename(partial, saved)
            return model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


# The files that take longest, longest first (worker seconds per file in a CI-selection run,
# 2026-11-28: 90 s down to 10 s; the rest take under 10 s each). xdist's `loadfile` hands out
# files with the most tests first, so files with a few long tests would start last and run alone
# at the end while the other worker idles (test_default_model.py's 30 s did): these are handed
# out first, and the short files fill in at the end.
LONGEST_FILES = (
    "test_sharding.py", "test_soak.py", "test_shapes.py", "test_ray_serve.py",  # slow only
    "test_prefill_extend.py", "test_equivalence_matrix.py", "test_lm_eval.py", "test_packed.py",
    "test_parity_hf.py", "test_batcher.py", "test_default_model.py", "test_int8.py",
    "test_seq_cls.py", "test_memory_guard.py", "test_lora_scorer.py",
    "test_cpu_segment_attention.py", "test_selection.py", "test_lowering.py",
    "test_cpu_attention.py", "test_executables.py", "test_multi_query.py",
    "test_segment_attention_gpu.py", "test_loglikelihood.py", "test_gemma.py", "test_chunking.py",
    "test_scorer.py", "test_jobs.py", "test_jobs_chunking.py", "test_precision.py",
    "test_completions.py", "test_lora_loglikelihood.py", "test_calibration.py",
    "test_score_batch.py", "test_prefix_cache.py", "test_lora.py", "test_docs_examples.py",
    "test_loading.py", "test_jobs_faults.py",
)  # fmt: skip


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with `LONGEST_FILES` handed out first (its other files as xdist orders
    them). Leans on the scheduler's `workqueue` (pytest-xdist 3.x); without it, xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            queued = {scope.rsplit("/", 1)[-1]: scope for scope in self.workqueue}
            first = next((queued[name] for name in LONGEST_FILES if name in queued), None)
            if first is not None:
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
