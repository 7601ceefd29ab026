"""The platform is resolved once, into the model, and passed down (compiles nothing)."""

import functools

import attrs
import numpy as np

from helpers import SMOLLM2_135M
from tpuscore.backends import registry
from tpuscore.backends.packed.backend import (
    PackedDenseBackend,
    PackedOptions,
    PackedSegmentBackend,
    PackedSegmentOptions,
)
from tpuscore.backends.prefill_extend.steps import key_blocks, keys_read
from tpuscore.engine import shapes
from tpuscore.engine.planning import FixedRule
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models.attention import score_block_tokens
from tpuscore.models.model import Model
from tpuscore.parallel.sharding import ONE_DEVICE


def test_key_blocks_follow_the_platform_given_not_the_process():
    assert key_blocks(2048, platform="cpu") > 1
    assert key_blocks(2048, platform="tpu") == key_blocks(2048, platform="gpu") == 1
    assert keys_read(2048, 10, platform="tpu") == 2048  # one block: all of it
    assert keys_read(2048, 10, platform="cpu") < 2048


def test_the_model_holds_its_layouts_platform():
    model = Model(None, params=None, dtype=np.dtype(np.float32), platform="tpu")
    assert model.platform == "tpu"
    assert Model(None, None, np.dtype(np.float32)).platform == ONE_DEVICE.platform


def test_auto_shapes_take_the_platform_given(monkeypatch):
    # packed_segment as a backend compiled on TPU and GPU only (a Pallas kernel alone)
    registration = registry.registration("packed_segment")
    capabilities = attrs.evolve(registration.capabilities, compiled_on=frozenset({"tpu", "gpu"}))
    monkeypatch.setitem(
        registry._REGISTRY, "packed_segment", attrs.evolve(registration, capabilities=capabilities)
    )
    on_tpu = shapes.backends_for("auto", object(), "tpu")
    on_cpu = shapes.backends_for("auto", object(), "cpu")
    assert "packed_segment" in on_tpu and "packed_segment" not in on_cpu
    assert shapes.backends_for("auto", FixedRule(), "tpu") == ["prefill_extend", "serial"]


def test_score_blocks_follow_the_platform_given_not_the_process():
    """decoder.extend's shared-prefix score blocks: an L2-sized block on CPU, a large one on an
    accelerator, whichever platform this process runs on."""
    per_token = 4 * 8 * 512  # float32 scores of 8 heads against 512 keys
    on_cpu = score_block_tokens(4096, per_token, platform="cpu")
    on_tpu = score_block_tokens(4096, per_token, platform="tpu")
    assert on_cpu < on_tpu == 4096


def test_the_segment_kernel_interprets_off_its_tiles_platform():
    """packed_segment passes `interpret` from the model's platform to its jitted step, so the
    step's static arguments (and executables) do not depend on the process's default backend."""

    def on(platform, kind=PackedSegmentBackend, options=PackedSegmentOptions):
        model = Model(SMOLLM2_135M, params=None, dtype=np.dtype(np.float32), platform=platform)
        return kind(model, options(activation_bytes=1 << 20)).interpret

    assert on("tpu") is False
    assert on("cpu") is False  # the fused C++ kernel (kernels/cpu_attention)
    tpu_tiles = functools.partial(PackedSegmentOptions, block_sizes=BlockSizes())
    assert on("cpu", options=tpu_tiles) is True
    assert on("tpu", PackedDenseBackend, PackedOptions) is None  # no kernel
