"""The released Kimi K3 text model (k3_techniques.md §1, HF moonshotai/Kimi-K3 text_config)."""
from experiments.configs import base


def get_config():
  c = base.get_base_config()
  c.name = "k3_full"
  return c
