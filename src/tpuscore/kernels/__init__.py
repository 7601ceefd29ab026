"""Device kernels, each with a pure-jnp reference (beside it, or named in its docstring)."""
