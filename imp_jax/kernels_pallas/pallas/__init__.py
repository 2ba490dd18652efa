"""Pallas kernels for NVIDIA GPUs (Mosaic GPU); on CPU they run in the interpreter, for tests."""
