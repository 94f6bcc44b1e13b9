"""k3jax: a JAX/Flax NNX reproduction of Kimi K3 (arXiv 2607.24653)."""
import flax

# Parameters carry logical axis names; the mapping to mesh axes is applied by
# `k3jax.sharding` from config rules, never eagerly at variable creation.
flax.config.update("flax_always_shard_variable", False)
