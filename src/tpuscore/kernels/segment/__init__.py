"""The segment (shared-prefix) attention kernel: a Pallas TPU kernel (`tpu.py`), a Triton GPU
kernel (`gpu.py`), and the mask rule they share with their jnp reference."""
