"""Writes tests/golden/kda_*.npz from fla-core 0.6.0's `naive_recurrent_kda` (torch, CPU).

Usage (from the repository root): `python3 tests/tools/make_fla_kda_golden.py`.
Without torch in the running interpreter it makes a throwaway venv (VENV, default
/tmp/fla_golden, Python 3.11), installs torch==2.13.0, fla-core==0.6.0 and numpy there
and re-runs itself with it. `fla.ops` imports triton, which a CPU box lacks, so
the oracle module `fla/ops/kda/naive.py` is loaded by its file path.

Each file holds float32 inputs q, k (L2-normalised), v, g, beta, optionally h0
and scale, and fla's outputs o and ht (the final state [B, H, K, V]).
"""
from importlib import metadata
import importlib.util
import os
import pathlib
import subprocess

try:
  import numpy as np
  import torch
except ImportError:  # Not the golden venv: main() re-runs this file there.
  np = torch = None

VENV = pathlib.Path(os.environ.get("VENV", "/tmp/fla_golden"))
OUT_DIR = pathlib.Path(__file__).resolve().parents[1] / "golden"
PINS = ("torch==2.13.0", "fla-core==0.6.0", "numpy")

# name: (B, T, H, K, V, gate, with h0, scale passed explicitly or None)
CASES = {
    "kda_golden_bounded": (2, 100, 2, 16, 16, "bounded", True, None),
    "kda_golden_unbounded": (1, 130, 2, 32, 16, "unbounded", False, 0.3),
}


def _reexec_in_venv() -> None:
  """Creates VENV if needed and replaces this process with this script run there."""
  python = VENV / "bin" / "python"
  if not python.exists():
    subprocess.run(["python3.11", "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
  os.execv(str(python), [str(python), __file__])


def _load_naive():
  """fla's `naive_recurrent_kda`, loaded from fla/ops/kda/naive.py by path."""
  spec = importlib.util.find_spec("fla")
  path = pathlib.Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
  module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.naive_recurrent_kda


def _inputs(rng, b: int, t: int, h: int, dk: int, dv: int, gate: str, with_h0: bool) -> dict:
  """fp32 inputs like `pallas_kernels.kda.reference.example_inputs`, from NumPy's rng."""
  def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)

  x = {
      "q": unit(rng.standard_normal((b, t, h, dk))),
      "k": unit(rng.standard_normal((b, t, h, dk))),
      "v": rng.standard_normal((b, t, h, dv)),
      "beta": 1 / (1 + np.exp(-rng.standard_normal((b, t, h)))),
  }
  # Per-channel offsets spread decay rates from ~1e-3 to ~3 per token.
  logits = rng.standard_normal((b, t, h, dk)) - 8.0 * rng.random((h, dk))
  if gate == "bounded":
    x["g"] = -5.0 / (1 + np.exp(-logits))
  else:
    g = -np.exp(rng.uniform(0, 1.5, (h, dk))) * np.logaddexp(0, logits + 1)
    g[rng.random((b, t, h, dk)) < 0.01] = -1000.0
    x["g"] = g
  if with_h0:
    x["h0"] = rng.standard_normal((b, h, dk, dv))
  return {name: a.astype(np.float32) for name, a in x.items()}


def main() -> None:
  if torch is None:
    _reexec_in_venv()
  naive_recurrent_kda = _load_naive()
  OUT_DIR.mkdir(parents=True, exist_ok=True)
  for seed, (name, (b, t, h, dk, dv, gate, with_h0, scale)) in enumerate(CASES.items()):
    x = _inputs(np.random.default_rng(seed), b, t, h, dk, dv, gate, with_h0)
    o, ht = naive_recurrent_kda(
        *(torch.from_numpy(x[n]) for n in ("q", "k", "v", "g", "beta")),
        scale=scale,
        initial_state=torch.from_numpy(x["h0"]) if with_h0 else None,
        output_final_state=True)
    extra = {} if scale is None else {"scale": np.float32(scale)}
    path = OUT_DIR / f"{name}.npz"
    np.savez(path, **x, **extra, o=o.numpy(), ht=ht.numpy(),
             source=np.str_(f"fla-core {metadata.version('fla-core')} naive_recurrent_kda, "
                            f"torch {torch.__version__}"))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
