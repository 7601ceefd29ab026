"""The CPU kernel's library cache (kernels/cpu_attention/library.py): a folder or file another
user could have written is never loaded; a library that does not load is built again; $CXX is
split as a shell would; a killed build's temporary file goes. These build a stand-in source (two
C functions, well under a second), not the kernel. And the kernel itself on non-finite inputs:
what XLA's ops give."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_seed
from tpuscore.api import processes
from tpuscore.kernels import cpu_attention
from tpuscore.kernels.cpu_attention import library
from tpuscore.models import attention

STAND_IN = """
extern "C" int tpuscore_cpu_supported() { return 1; }
extern "C" int tpuscore_cpu_bf16_dots() { return 0; }
extern "C" int TpuscorePrefixAttention() { return 0; }
extern "C" int TpuscoreSegmentAttention() { return 0; }
extern "C" int tpuscore_stand_in() { return 42; }
"""


@pytest.fixture
def cxx() -> list[str]:
    """The compiler: CI has one (a missing one fails there rather than skipping)."""
    found = shutil.which("c++") or shutil.which("g++")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler")
        pytest.skip("no C++ compiler")
    return [found]


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> list[str]:
    """The stand-in source in place of the kernel's; returns a list that records each build."""
    source = tmp_path / "stand_in.cc"
    source.write_text(STAND_IN)
    monkeypatch.setattr(library, "SOURCES", (source,))
    builds = []
    real = library._build
    monkeypatch.setattr(library, "_build", lambda cxx, out: (builds.append(out), real(cxx, out)))
    return builds


@pytest.fixture
def folder(tmp_path) -> Path:
    path = tmp_path / "kernels"
    path.mkdir(mode=0o700)
    return path


def _is_stand_in(lib) -> bool:
    return lib is not None and lib.tpuscore_stand_in() == 42


def test_built_once_then_loaded(cxx, stand_in, folder):
    assert _is_stand_in(library.load_library(cxx, folder))
    assert _is_stand_in(library.load_library(cxx, folder))
    (entry,) = folder.glob("*.so")
    assert stand_in == [entry]  # one build; the second call loaded it
    assert library.file_problem(entry) is None  # this user's, writable by no one else
    assert sorted(folder.iterdir()) == [entry, library.digest_of(entry)]
    assert library.digest_problem(entry) is None


@pytest.mark.parametrize("damage", ["a byte appended", "a byte changed", "no digest"])
def test_a_library_whose_bytes_are_not_those_built_is_built_again(
    cxx, stand_in, folder, caplog, damage
):
    """A damaged library that still loads (a byte appended past its sections loads as before)
    would run: it is built again, as is one without a digest (an older tpuscore's build)."""
    library.load_library(cxx, folder)
    (entry,) = folder.glob("*.so")
    data = bytearray(entry.read_bytes())
    if damage == "a byte appended":
        data += b"\0"
    elif damage == "a byte changed":
        data[len(data) // 2] ^= 0x40
    else:
        library.digest_of(entry).unlink()
    # A new file in its place: this process has the library mapped, and writing into a mapped
    # library in place would crash it (as it would any process running it).
    damaged = entry.with_name("damaged")
    damaged.write_bytes(bytes(data))
    damaged.chmod(0o755)
    os.replace(damaged, entry)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _is_stand_in(library.load_library(cxx, folder))
    assert ("no digest" if damage == "no digest" else "not those built") in caplog.text
    assert stand_in == [entry, entry] and library.digest_problem(entry) is None


@pytest.mark.parametrize("how", ["a wrapper before it", "a quoted path with a space"])
def test_cxx_is_split_as_a_shell_would(cxx, stand_in, folder, tmp_path, monkeypatch, how):
    """CXX="ccache g++" and CXX='"/opt/my tools/g++"' build (they were run as one program name,
    which does not exist: the kernel was silently off)."""
    if how == "a wrapper before it":
        value = f"env LC_ALL=C {cxx[0]}"
    else:
        tools = tmp_path / "my tools"
        tools.mkdir()
        (tools / "c++").symlink_to(cxx[0])
        value = f'"{tools / "c++"}"'
    monkeypatch.setenv("CXX", value)
    command = library.compiler()
    assert len(command) == (3 if how == "a wrapper before it" else 1)
    assert _is_stand_in(library.load_library(command, folder))
    assert len(stand_in) == 1


def test_an_unbalanced_cxx_is_refused(monkeypatch):
    monkeypatch.setenv("CXX", '"g++')
    with pytest.raises(ValueError):
        library.compiler()


def test_a_library_that_does_not_load_is_built_again(cxx, stand_in, folder, caplog):
    entry = folder / library.entry_name(cxx)
    entry.write_bytes(b"not an ELF file")
    entry.chmod(0o644)
    library.digest_of(entry).write_text(library._sha256(entry))  # its digest: it gets to dlopen
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _is_stand_in(library.load_library(cxx, folder))
    assert "does not load" in caplog.text
    assert stand_in == [entry]
    assert entry.read_bytes()[:4] == b"\x7fELF"


def test_a_library_writable_by_others_is_built_again(cxx, stand_in, folder, caplog):
    """A library in a trusted folder that others could write (or not this user's) is removed
    and built again, never loaded."""
    library.load_library(cxx, folder)
    (entry,) = folder.glob("*.so")
    entry.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _is_stand_in(library.load_library(cxx, folder))
    assert "writable by other users" in caplog.text
    assert stand_in == [entry, entry] and library.file_problem(entry) is None


@pytest.mark.parametrize("problem", ["writable by others", "another owner"])
def test_an_untrusted_folder_is_never_loaded_from(
    cxx, stand_in, folder, monkeypatch, caplog, problem
):
    """A library planted in a folder another user can write (or owns) is not loaded: the kernel
    is built into a private temporary folder, and the planted file stays untouched."""
    planted = folder / library.entry_name(cxx)
    planted.write_bytes(b"planted")
    if problem == "writable by others":
        folder.chmod(0o777)
    else:
        uid = os.getuid()
        monkeypatch.setattr(library.os, "getuid", lambda: uid + 4242)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        lib = library.load_library(cxx, folder)
    assert _is_stand_in(lib)
    assert "Not using the kernel cache" in caplog.text
    assert len(stand_in) == 1 and stand_in[0].parent != folder
    assert not stand_in[0].parent.exists()  # the private folder is gone; the library stays loaded
    assert planted.read_bytes() == b"planted"


def test_a_folder_under_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)  # others could rename kernels/ and put their own in its place
    assert "writable by other users" in library.folder_problem(shared / "kernels")
    shared.chmod(0o1777)  # sticky, as /tmp: they cannot
    assert library.folder_problem(shared / "kernels") is None


def test_missing_folders_are_created_private(cxx, stand_in, tmp_path):
    folder = tmp_path / "new" / "kernels"
    assert _is_stand_in(library.load_library(cxx, folder))
    for path in (folder, folder.parent):
        assert path.stat().st_mode & 0o077 == 0


def test_a_killed_builds_temporary_file_goes(cxx, stand_in, folder):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    host = processes.host_tag()
    leftover = folder / f".build-{int(dead.stdout)}-{host}-abc.so"
    live = folder / f".build-{os.getpid()}-{host}-abc.so"
    old = folder / ".build-1-0badc0de-abc.so"
    for path in (leftover, live, old):
        path.write_bytes(b"half")
    os.utime(old, (0, old.stat().st_mtime - library.STALE_SECONDS - 60))
    library.load_library(cxx, folder)
    assert not leftover.exists() and not old.exists() and live.exists()


def test_the_least_recently_loaded_builds_go_past_the_cap(cxx, stand_in, folder, monkeypatch):
    """Builds for other compilers or jaxlibs stay up to TPUSCORE_KERNEL_CACHE_MAX_ENTRIES (this
    process's counts), the least recently loaded going first."""
    others = [folder / f"prefix_attention-other{n}.so" for n in range(3)]
    for n, path in enumerate(others):
        path.write_bytes(b"an older build")
        os.utime(path, (0, 1000 + n))
    monkeypatch.setenv(library.MAX_ENTRIES_ENV, "3")
    library.load_library(cxx, folder)
    assert sorted(p.name for p in folder.glob("*.so")) == sorted(
        [library.entry_name(cxx), others[1].name, others[2].name]
    )
    monkeypatch.setenv(library.MAX_ENTRIES_ENV, "1")
    library.load_library(cxx, folder)
    kept = folder / library.entry_name(cxx)
    assert sorted(folder.iterdir()) == [kept, library.digest_of(kept)]


def test_a_failed_build_warns_and_leaves_nothing(stand_in, folder, caplog, monkeypatch):
    monkeypatch.setattr(library, "SOURCES", (folder.parent / "missing.cc",))
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert library.load_library(["false"], folder) is None
    assert "did not build" in caplog.text
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: what XLA's ops give

needs_kernel = pytest.mark.skipif(
    not cpu_attention.available(), reason="needs x86-64 Linux with AVX-512F and a C++ compiler"
)
kernel = jax.jit(cpu_attention.prefix_attention, static_argnames="scale")


@functools.partial(jax.jit, static_argnames="scale")
def reference(q, k, v, length, scale):
    layer = attention.LayerAttention(window=None, scale=scale, softcap=None)
    return attention._prefix_parts(q, k, v, jnp.arange(k.shape[-1]) < length, layer)


GEOMETRIES = [(7, 2, 2, 16, 40), (3, 1, 3, 64, 33)]  # T, K, G, H, P: two compiles each


@needs_kernel
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), geometry=st.sampled_from(GEOMETRIES))
def test_non_finite_inputs_give_what_xla_gives(data, geometry):
    """NaN, inf and -inf put in q, and in k and v before `length`: the kernel's o, max and exp
    sum are NaN, inf or -inf where XLA's ops (`attention._prefix_parts`) give them, and equal
    within float32 rounding elsewhere. (Its max skipped NaN and its exp turned NaN into
    exp(-87): a NaN'd model scored finite.)"""
    T, K, G, H, P = geometry
    rng = np.random.default_rng([run_seed(), data.draw(st.integers(0, 2**32 - 1), label="seed")])
    length = data.draw(st.integers(1, P), label="length")
    q = rng.standard_normal((1, T, K * G, H)).astype(np.float32)
    k = rng.standard_normal((K, H, P)).astype(np.float32)
    v = rng.standard_normal((K, P, H)).astype(np.float32)
    for live in (q, k[..., :length], v[:, :length]):  # views: k and v past length stay finite
        for _ in range(data.draw(st.integers(0, 3), label="count")):
            where = tuple(rng.integers(0, n) for n in live.shape)
            live[where] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
    scale = H**-0.5
    got = kernel(q, k, v, jnp.int32(length), scale=scale)
    want = reference(q, k, v, jnp.int32(length), scale=scale)
    for name, a, b in zip(("o", "max", "sum"), got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{name}: NaN")
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{name}: inf")
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{name}: -inf")
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], rtol=1e-4, atol=1e-5, err_msg=name)


@needs_kernel
def test_a_nan_in_one_row_stays_in_that_row(rng):
    """A NaN in one query row makes that row's parts NaN and leaves every other row equal to
    the clean call, bit for bit."""
    K, G, H, P, length = 2, 2, 16, 40, 33
    q = rng.standard_normal((1, 7, K * G, H)).astype(np.float32)
    k = rng.standard_normal((K, H, P)).astype(np.float32)
    v = rng.standard_normal((K, P, H)).astype(np.float32)
    clean = [np.array(x) for x in kernel(q, k, v, jnp.int32(length), scale=0.25)]
    q[0, 3, 0, 5] = np.nan  # row 3, query head 0: kv head 0, group 0
    poisoned = [np.array(x) for x in kernel(q, k, v, jnp.int32(length), scale=0.25)]
    for a, b in zip(clean, poisoned, strict=True):
        assert np.isnan(b[0, 3, 0, 0]).all()
        b[0, 3, 0, 0], a[0, 3, 0, 0] = 0, 0
        np.testing.assert_array_equal(a, b)
