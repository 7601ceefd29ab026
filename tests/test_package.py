"""The package's import surface: the layers load lazily, and the tasks stand on the engine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tpuscore

SRC = Path(tpuscore.__file__).parents[1]
HEAVY = ("tpuscore.backends", "tpuscore.kernels", "tpuscore.models", "tpuscore.scorer", "jax")


def loaded_after(code: str) -> list[str]:
    """The modules of HEAVY that a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    modules = json.loads(done.stdout.splitlines()[-1])
    return [m for m in modules if m.startswith(HEAVY)]


def test_importing_the_api_loads_no_backend_kernel_or_model():
    code = "import tpuscore.api, tpuscore.api.requests, tpuscore.api.validation"
    assert loaded_after(code) == []
    assert loaded_after("from tpuscore import ScoreOptions, ValidationError") == []


def test_the_public_names_load_on_first_use():
    assert "tpuscore.scorer" in loaded_after("from tpuscore import Scorer")
    assert "tpuscore.backends" in loaded_after("import tpuscore; tpuscore.backends.register")
    assert set(tpuscore.__all__) <= set(dir(tpuscore))
    for name in tpuscore.__all__:
        assert getattr(tpuscore, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        tpuscore.no_such_name  # noqa: B018


def test_the_tasks_do_not_import_the_facade():
    for path in (SRC / "tpuscore" / "tasks").glob("*.py"):
        assert "tpuscore.scorer" not in path.read_text(), path
