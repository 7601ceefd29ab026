"""Device profiles: the constants `selection.py`'s time model prices a step with.

A profile is a JSON file (`DeviceProfile.save` writes one; `python -m tpuscore.cli.calibrate` fits
one on the current machine). The built-in ones sit next to this module: `cpu.json` (a 2-core CPU)
and `h200.json` (an NVIDIA H200, which a GH200's device kind matches too) were fitted by the
calibration script; `tpu-v5e.json`, `tpu-v6e.json` and `h100.json` come from the chips' spec
sheets and say `"measured": false`. `for_device` picks one by device kind.
"""

from __future__ import annotations

import json
import logging
import math
import os
from importlib import resources
from typing import Any

import attrs
import jax

from tpuscore.api.errors import ValidationError

logger = logging.getLogger(__name__)

BUILT_IN = ("cpu", "tpu-v5e", "tpu-v6e", "h100", "h200")
FALLBACK = {"cpu": "cpu", "tpu": "tpu-v6e", "gpu": "h100"}  # an unknown chip of each platform


@attrs.frozen(kw_only=True)
class DeviceProfile:
    """What one step costs on a device: `step_seconds` fixed per step (dispatch, launch), matmul
    FLOPs at `matmul_flops[dtype]` per second, bytes read at `memory_bandwidth` per second, each
    attention score (its exp and softmax share) `score_seconds`, and `interpret_penalty` times the
    whole estimate for a step run in Pallas interpret mode.

    `device_kinds`: substrings of `jax.Device.device_kind` it is for. `measured`: fitted by
    calibration on such a device (else taken from a spec sheet). `source`: how it was made."""

    name: str
    device_kinds: tuple[str, ...] = attrs.field(converter=tuple)
    matmul_flops: dict[str, float]
    memory_bandwidth: float
    step_seconds: float
    score_seconds: float
    interpret_penalty: float
    measured: bool
    source: str = ""

    def matmul_rate(self, dtype: Any) -> float:
        """FLOP/s for this dtype's matmuls: float32's if the profile lacks it, and the slowest
        it has if it lacks that too (a profile calibrated in one dtype only)."""
        name = jax.numpy.dtype(dtype).name
        rates = self.matmul_flops
        return rates.get(name) or rates.get("float32") or min(rates.values())

    @classmethod
    def load(cls, path: str | os.PathLike) -> DeviceProfile:
        """The profile in a file `save` (or `tpuscore calibrate`) wrote; anything else, or a
        file that cannot be read, is `ValidationError("invalid_profile")`."""

        def invalid(why: str) -> ValidationError:
            return ValidationError("invalid_profile", f"{os.fspath(path)} {why}", "profile")

        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise invalid(f"cannot be read as JSON: {e}") from None
        if not isinstance(data, dict):
            raise invalid(f"is not a device profile: a JSON {type(data).__name__}")
        try:
            profile = cls(**data)
        except TypeError as e:  # a missing or unknown field
            raise invalid(f"is not a device profile: {e}") from None
        # Calibration's non-negative fit may give a cost of 0 (`tpuscore calibrate`); a rate
        # of 0 would divide by it.
        rates = [*profile.matmul_flops.values(), profile.memory_bandwidth]
        costs = [profile.step_seconds, profile.score_seconds, profile.interpret_penalty]
        if not rates[:-1] or not all(_number(r) and r > 0 for r in rates):
            raise invalid("is malformed: matmul_flops and memory_bandwidth must be rates > 0")
        if not all(_number(c) and c >= 0 for c in costs):
            raise invalid("is malformed: its seconds and penalty must be numbers >= 0")
        return profile

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(attrs.asdict(self), f, indent=2)
            f.write("\n")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def built_in(name: str) -> DeviceProfile:
    """One of `BUILT_IN` by name."""
    if name not in BUILT_IN:
        raise ValueError(f"no built-in profile {name!r}; built in: {', '.join(BUILT_IN)}")
    with resources.files(__package__).joinpath(f"{name}.json").open() as f:
        return DeviceProfile(**json.load(f))


def for_device(device: jax.Device | None = None) -> DeviceProfile:
    """The built-in profile whose device kinds match `device` (default the first device), else
    the platform's fallback, with a warning that its constants are not this chip's."""
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    for name in BUILT_IN:
        profile = built_in(name)
        if any(k.lower() in kind for k in profile.device_kinds):
            return profile
    fallback = FALLBACK.get(device.platform, "cpu")
    logger.warning(
        "no device profile for %r; using %r (run python -m tpuscore.cli.calibrate for one)",
        device.device_kind, fallback,
    )  # fmt: skip
    return built_in(fallback)
