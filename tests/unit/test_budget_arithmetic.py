"""Memory budgets (backends/budgets.py): shares of a device that reports its memory, fixed bytes
on CPU, and a backend's budget under its safety factor. Devices are stand-ins: nothing runs."""

import attrs
import pytest

from tpuscore.backends import budgets


@attrs.frozen
class Device:
    platform: str
    stats: dict | None

    def memory_stats(self):
        return self.stats


@pytest.fixture
def device(monkeypatch):
    """Set the first device budgets.py sees."""

    def use(platform: str, stats: dict | None = None) -> None:
        monkeypatch.setattr(budgets.jax, "devices", lambda: [Device(platform, stats)])

    return use


def test_an_accelerator_that_reports_its_limit_gets_shares_of_it(device):
    device("gpu", {"bytes_limit": 80_000, "bytes_in_use": 30_000})
    assert budgets.cache_budget() == 8_000  # a tenth
    assert budgets.activation_budget() == 10_000  # an eighth
    assert budgets.memory_budget(0.5, cpu_bytes=7) == 40_000
    assert budgets.device_capacity() == 50_000  # the limit less what is in use


@pytest.mark.parametrize("stats", [None, {}, {"bytes_limit": 0}])
def test_an_accelerator_without_a_limit_gets_the_cpu_bytes(device, stats):
    device("tpu", stats)
    assert budgets.cache_budget() == budgets.CPU_CACHE_BYTES == 1 << 30
    assert budgets.activation_budget() == budgets.CPU_ACTIVATION_BYTES == 1 << 28


def test_cpu_ignores_memory_stats_and_takes_the_hosts_available_memory(device, monkeypatch):
    device("cpu", {"bytes_limit": 80_000})  # a CPU's stats are not its budget
    assert budgets.activation_budget() == budgets.CPU_ACTIVATION_BYTES
    meminfo = "MemTotal:       16000 kB\nMemFree:  100 kB\nMemAvailable:    12345 kB\n"
    monkeypatch.setattr(budgets, "open", lambda *_: _Text(meminfo), raising=False)
    assert budgets.device_capacity() == 12345 * 1024


def test_cpu_capacity_without_meminfo_falls_back_to_sysconf(device, monkeypatch):
    device("cpu")

    def unreadable(*_):
        raise OSError("no /proc here")

    monkeypatch.setattr(budgets, "open", unreadable, raising=False)
    sysconf = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000}
    monkeypatch.setattr(budgets.os, "sysconf", sysconf.__getitem__)
    assert budgets.device_capacity() == 4096 * 1000


class _Text:
    """A file opened for reading (a context manager iterating lines)."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)

    def __enter__(self):
        return iter(self.lines)

    def __exit__(self, *_):
        return False


class Backend(budgets.Budgeted):
    activation_bytes = 1000


def test_a_backends_budget_halves_each_time_its_safety_grows():
    backend, other = Backend(), Backend()
    assert (backend.safety, backend.budget, backend.peak_budget) == (1.0, 1000, 1000)
    assert [backend.grow_safety() for _ in range(3)] == [2.0, 4.0, 8.0]
    assert (backend.budget, backend.peak_budget) == (125, 125)
    assert (other.safety, other.budget) == (1.0, 1000)  # the factor is the instance's own
    for _ in range(20):
        backend.grow_safety()
    assert backend.budget == 1  # never zero: a step of one row still gets planned
