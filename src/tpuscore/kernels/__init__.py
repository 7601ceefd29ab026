"""Pallas kernels, each with a pure-jnp reference beside it (none yet)."""
