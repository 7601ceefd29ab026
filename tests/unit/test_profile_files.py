"""A device profile file (`profile=` of `Scorer.from_pretrained`, `tpuscore --profile`): what
`save` wrote loads back equal; anything else is `invalid_profile`, naming the file."""

import json

import attrs
import pytest

from tpuscore.api.errors import ValidationError
from tpuscore.engine.profiles import BUILT_IN, DeviceProfile, built_in


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_saved_profile_loads_back_equal(tmp_path, name):
    built_in(name).save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == built_in(name)


def test_a_fitted_cost_of_zero_is_accepted(tmp_path):
    """Calibration's non-negative fit may zero a cost (`cli/calibrate.fit`)."""
    fitted = attrs.evolve(built_in("cpu"), step_seconds=0.0, score_seconds=0.0)
    fitted.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == fitted


def _saved(tmp_path, **changes):
    data = {**attrs.asdict(built_in("cpu")), **changes}
    (tmp_path / "p.json").write_text(json.dumps(data))
    return data


@pytest.mark.parametrize(
    "write, why",
    [
        (lambda path: path.write_text('{"name": "cut'), "cannot be read as JSON"),
        (lambda path: path.write_text("[1, 2]"), "not a device profile: a JSON list"),
        (lambda path: None, "cannot be read as JSON"),  # no file
    ],
)
def test_a_file_that_is_not_a_profile_is_named(tmp_path, write, why):
    write(tmp_path / "p.json")
    with pytest.raises(ValidationError, match=why) as raised:
        DeviceProfile.load(tmp_path / "p.json")
    assert raised.value.code == "invalid_profile"
    assert raised.value.loc == ("profile",)
    assert str(tmp_path / "p.json") in raised.value.message


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"device_kind": "cpu"}, "unexpected keyword argument 'device_kind'"),
        ({"matmul_flops": {}}, "must be rates > 0"),
        ({"matmul_flops": {"float32": 0}}, "must be rates > 0"),
        ({"matmul_flops": {"float32": "fast"}}, "must be rates > 0"),
        ({"memory_bandwidth": -1.0}, "must be rates > 0"),
        ({"step_seconds": -0.001}, "must be numbers >= 0"),
        ({"score_seconds": True}, "must be numbers >= 0"),
    ],
)
def test_a_malformed_profile_is_refused(tmp_path, changes, why):
    data = _saved(tmp_path, **changes)
    if "device_kind" not in changes:
        assert set(data) == set(attrs.fields_dict(DeviceProfile))
    with pytest.raises(ValidationError, match=why) as raised:
        DeviceProfile.load(tmp_path / "p.json")
    assert raised.value.code == "invalid_profile"
