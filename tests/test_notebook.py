"""examples/functional_api.ipynb runs top to bottom in a fresh kernel."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "functional_api.ipynb"


@pytest.mark.slow
def test_functional_api_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    last = nb.cells[-1].outputs[-1]["data"]["text/plain"]
    assert "loss" not in last or "nan" not in last.lower()
