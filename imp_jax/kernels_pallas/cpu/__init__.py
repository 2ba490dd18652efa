"""C++ kernels for x86-64 CPUs, called as XLA FFI custom calls and built with the system compiler."""
