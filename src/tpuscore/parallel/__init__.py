"""Where arrays live: a layout over a mesh of devices, and several hosts."""
