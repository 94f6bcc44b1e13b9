"""Running a test script on virtual CPU devices in a subprocess (the mesh tests)."""
import json
import os
import subprocess
import sys


def run_on_devices(script: str, devices: int = 8, timeout: int = 600) -> dict:
  """Runs `script` with `devices` virtual CPU devices; returns the JSON it prints after
  "RESULT". A failing script fails the test with the end of its stderr."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=timeout, env=env)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.split("RESULT", 1)[1])
