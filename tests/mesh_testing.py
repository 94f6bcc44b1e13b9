"""Running a test script on virtual CPU devices in a subprocess (the mesh tests)."""
import json
import os
import subprocess
import sys


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
  """This process's environment for a subprocess on `devices` virtual CPU devices, keeping the
  XLA_FLAGS the tests run with (conftest.py)."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", **extra)


def run_on_devices(script: str, devices: int = 8, timeout: int = 600) -> dict:
  """Runs `script` with `devices` virtual CPU devices; returns the JSON it prints after
  "RESULT". A failing script fails the test with the end of its stderr."""
  env = cpu_env(devices)
  res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=timeout, env=env)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.split("RESULT", 1)[1])
