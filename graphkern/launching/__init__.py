"""Launching kernels: backends, validation, MLX kernel objects, launch paths, caches, autodiff."""
