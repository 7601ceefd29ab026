"""The tests' random inputs come from one seed per run, and a printed seed replays them."""

import pytest

from helpers import SEED_ENV, run_seed, seeded_rng


def test_a_seed_replays_every_keys_draws(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "1234")
    first = [seeded_rng(key).integers(0, 2**31, size=4).tolist() for key in ("a", "b")]
    again = [seeded_rng(key).integers(0, 2**31, size=4).tolist() for key in ("a", "b")]
    assert run_seed() == 1234
    assert first == again
    assert first[0] != first[1]
    monkeypatch.setenv(SEED_ENV, "1235")
    assert seeded_rng("a").integers(0, 2**31, size=4).tolist() != first[0]


def test_a_seed_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "-3")
    with pytest.raises(ValueError, match="TPUSCORE_TEST_SEED='-3'"):
        run_seed()
