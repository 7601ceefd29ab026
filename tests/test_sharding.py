"""Sharding over 8 CPU devices: runs tests/sharded_checks.py in a pytest subprocess, since JAX
fixes its device count when it starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow  # a subprocess
def test_sharded_scorers_on_8_cpu_devices():
    env = os.environ | {"JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(HERE / "sharded_checks.py")],
        env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(result.stdout[-5000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
