"""Plain-XLA kernels: the portable backend, and the attention oracle the tests compare against."""
