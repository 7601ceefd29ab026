"""The segment (shared-prefix) attention kernel: the mask rule, its jnp reference and the input
checks (`mask.py`), a Pallas TPU kernel (`tpu.py`) and a Triton GPU kernel (`gpu.py`)."""
