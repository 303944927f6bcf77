"""The package layout is the architecture: every import points down the layers, and the demo application
(``a3po_trl.tasks``) is never loaded by the trainer. Read from the source with ``ast``, nothing imported."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "a3po_trl"

#: Layers, bottom first: a module may import from its own layer only inside its own subpackage, and from lower ones.
#: The longest matching prefix gives a module's layer.
LAYERS = {
    "a3po_trl.config": 0,
    "a3po_trl.types": 0,
    "a3po_trl.padding": 0,
    "a3po_trl.functional": 1,
    "a3po_trl.timeline": 1,  # the span recorder both threads write to
    "a3po_trl.timeline.plot": 7,  # draws a trace (matplotlib, imported lazily)
    "a3po_trl.patches": 1,
    "a3po_trl.runtime": 1,  # devices, device work timed by events (both threads), the process group's agreements
    "a3po_trl.generation.weights": 2,  # the weight path: gather, dtype, staging store, copies, memory plan
    "a3po_trl.generation": 3,  # the batch producer, the queue, the schedule, the backend interface
    "a3po_trl.generation.hf": 4,
    "a3po_trl.generation.vllm": 4,
    "a3po_trl.generation.__init__": 5,  # exports the default backend
    "a3po_trl.rollout": 6,
    "a3po_trl.metrics": 6,  # what is logged: batch.py, loss.py (pure functions of tensors)
    "a3po_trl.proximal": 7,  # the proximal anchor: the methods, the guard, the previous version's weights
    "a3po_trl.losses": 8,
    "a3po_trl.validation": 7,
    "a3po_trl.builders": 7,  # what the generation thread needs, read off the trainer once, by concern
    "a3po_trl.checkpoints": 8,  # complete folders, atomic saves, the resume decision; reads trainer internals
    "a3po_trl.training_batch": 8,  # the main thread's half of the batch path: a scored batch becomes a training batch
    "a3po_trl.checkpoints.run_state": 9,  # what a checkpoint keeps of the run beyond Trainer's (reads the builders')
    "a3po_trl.trainer": 10,
    "a3po_trl.__init__": 11,
    "a3po_trl.cli": 11,  # the `a3po-trl grpo` command: TRL's script arguments, the trainer
    "a3po_trl.tasks": 12,
}


def module_files() -> dict[str, Path]:
    """``{dotted name: file}``; a package's ``__init__`` is named ``<package>.__init__``."""
    return {
        ".".join(("a3po_trl", *path.relative_to(PACKAGE).with_suffix("").parts)): path
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def layer(module: str) -> int:
    names = [name for name in LAYERS if module == name or module.startswith(name + ".")]
    if not names:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/unit/test_layout.py")
    return LAYERS[max(names, key=len)]


def subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:-1])


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports anywhere in its file (top level or inside functions)."""
    package = subpackage(module)
    found = set()

    def resolve(name: str) -> str | None:
        if name in modules:
            return name
        if name + ".__init__" in modules:
            return name + ".__init__"
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if resolve(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        found.update(t for t in map(resolve, targets) if t is not None and t != module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def test_every_import_points_down_the_layers():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            same_room = subpackage(target) == subpackage(module) or target == subpackage(module) + ".__init__"
            if layer(target) > layer(module) or (layer(target) == layer(module) and not same_room):
                upward.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_imports_form_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(module, trail):
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                raise AssertionError(" -> ".join([*trail, module, target]))
            if target not in state:
                visit(target, [*trail, module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_only_the_demo_imports_the_demo():
    offenders = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.startswith("a3po_trl.tasks") and not module.startswith("a3po_trl.tasks")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_config_imports_nothing_of_the_package():
    assert import_graph()["a3po_trl.config"] == set()


def test_importing_the_package_loads_no_demo_code():
    code = "import sys, a3po_trl; print(sorted(m for m in sys.modules if m.startswith('a3po_trl.tasks')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module", ["a3po_trl.rollout.run", "a3po_trl.generation.hf.backend"])
def test_the_layer_check_sees_an_upward_import(module, tmp_path):
    """The check itself: an import of the trainer from a lower layer is reported."""
    modules = module_files()
    path = tmp_path / "module.py"
    path.write_text(modules[module].read_text() + "\nfrom a3po_trl.trainer import AsyncA3POTrainer\n")
    targets = imports_of(module, path, modules)
    assert "a3po_trl.trainer" in targets and layer("a3po_trl.trainer") > layer(module)
