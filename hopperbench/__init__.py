"""hopperbench: a reproducible H200 benchmark of contest kernels (see README.md)."""
