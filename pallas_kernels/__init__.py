"""Kernels for k3jax ops, each with a reference tier, a chunked JAX tier and (later) Pallas tiers."""
