"""Execute both notebooks end to end (nbclient) in smoke mode: a couple of steps, a few problems, no cell may fail.

Smoke mode (``A3PO_NOTEBOOK_SMOKE=1``) is read by the notebooks themselves; ``A3PO_NOTEBOOK_MODEL`` and
``A3PO_NOTEBOOK_OUTPUT`` point them at the model and at a temporary output directory. The notebooks run on the real
SmolLM2-135M-Instruct (converted once and cached by ``ensure_smollm2``).
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture(scope="module")
def smollm2_dir():
    from a3po_trl.tasks.offline_model import ensure_smollm2

    return ensure_smollm2()


@pytest.mark.parametrize("name", ["lora_quickstart.ipynb", "loglinear_vs_recompute.ipynb"])
def test_notebook_runs_in_smoke_mode(name, smollm2_dir, tmp_path, monkeypatch):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{name} is stored with outputs; clear them before committing"
    )
    monkeypatch.setenv("A3PO_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("A3PO_NOTEBOOK_MODEL", str(smollm2_dir))
    monkeypatch.setenv("A3PO_NOTEBOOK_OUTPUT", str(tmp_path / "out"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    if name == "lora_quickstart.ipynb":
        assert (tmp_path / "out" / "adapter_config.json").is_file()
        assert (tmp_path / "out" / "training.png").is_file()
        images = [output for output in outputs if "image/png" in output.get("data", {})]
        assert len(images) >= 2, "the inline plot and the PNG are displayed"
    else:  # what the text says smoke mode shows: two optimizer steps per method, one batch trained at staleness 0, 1
        printed = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
        for method in ("loglinear", "recompute"):
            assert f"{method}: 2 optimizer steps in" in printed and "staleness up to 1\n" in printed, printed
