"""GPU kernels, compiled on first use and only where the backend has them."""
