"""Executes every notebook in notebooks/ top to bottom (issue: what a newcomer meets).

Each notebook runs in a temporary copy with a kernel on this interpreter (a kernelspec written
for `sys.executable`, so it works in .venv on a clean machine without `ipykernel install`); a cell
error fails the test, and the executed notebook must show at least one image/png plot.
"""
import json
import pathlib
import shutil
import sys

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "k3jax-test"


def test_notebooks_found():
  assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "k3jax test", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  work = tmp_path / "notebooks"
  work.mkdir()
  copy = work / path.name
  shutil.copy(path, copy)
  nb = nbformat.read(copy, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs = []
  nbclient.NotebookClient(nb, timeout=600, kernel_name=KERNEL,
                          resources={"metadata": {"path": str(work)}}).execute()
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, f"{path.name}: no image/png output after execution"
