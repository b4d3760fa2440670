"""Packaging promises: a missing TensorFlow is named in one line with the extra to install; the
package imports in one direction, and its modules stay small."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_import_without_tensorflow_names_the_extra():
    # -I -S: no site-packages, so TensorFlow cannot be found; the repo is put on the path.
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import tfspeed"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tfspeed needs TensorFlow")
    assert "pip install 'tfspeed[cpu]'" in last and "'tfspeed[gpu]'" in last


def test_package_declares_the_tensorflow_extras():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(dep.startswith("tensorflow-cpu") for dep in extras["cpu"])
    assert any(dep.startswith("tensorflow[and-cuda]") for dep in extras["gpu"])
    names = {re.split(r"[<>=\[ ;]", dep)[0] for dep in project["dependencies"]}
    assert not names & {"tensorflow", "tensorflow-cpu"}, "TensorFlow is chosen by an extra"
    assert "tensorboard>=2.18" in project["dependencies"]  # tensorflow-cpu 2.21 no longer pulls it


# The layout (docs/architecture.md, "What may import what"): commands on top, library code
# below them, and imports that go one way, between modules and between packages.
COMMANDS = {"tfspeed.train", "tfspeed.tune", "tfspeed.diagnose", "tfspeed.verify",
            "tfspeed.launch", "tfspeed.data_service", "tfspeed.bench", "tfspeed.run"}
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in (REPO / "tfspeed").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> list[str]:
    """The tfspeed names a file imports, anywhere in it: at its top and inside functions
    (a lazy import is an import all the same; only its time differs). ``from tfspeed import x``
    names ``tfspeed.x``: the top package, ``import tfspeed``'s entry points, is no layer."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("tfspeed.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfspeed"):
            if node.module != "tfspeed":
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names]
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, with the packages that importing a module runs
    first (``a.b.c`` runs ``a.b``'s ``__init__``); a package importing its own modules left out."""
    modules = _modules()
    graph = {name: {t for t in _imports(path) if t in modules} for name, path in modules.items()}
    for name, targets in graph.items():
        parts = name.split(".")
        targets |= {".".join(parts[:i]) for i in range(2, len(parts))}
        graph[name] = {t for t in targets if t != name and not t.startswith(name + ".")}
    graph.pop("tfspeed")  # the top package: import tfspeed's entry points (tfspeed.fit)
    for targets in graph.values():
        targets.discard("tfspeed")
    return graph


def _package(module: str) -> str:
    """The package a module belongs to (``tfspeed.training``), or the command it is."""
    return ".".join(module.split(".")[:2])


def _assert_no_cycle(graph: dict[str, set[str]]) -> None:
    """Fails naming every loop a depth-first walk of ``graph`` closes."""
    state, loops = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                loops.append(" -> ".join([*stack[stack.index(nxt):], node, nxt]
                                         if nxt in stack else [node, nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not loops, "import cycles: " + "; ".join(loops)


def test_library_code_never_imports_a_command():
    for name, targets in _import_graph().items():
        if name in COMMANDS or name in ("tfspeed.util.cli", "tfspeed.convert.cli"):
            continue
        bad = sorted(t for t in targets if t in COMMANDS or t == "tfspeed.util.cli")
        assert not bad, f"{name} imports command-line code {bad}"


def test_no_import_cycles_between_modules():
    _assert_no_cycle(_import_graph())


def test_no_import_cycles_between_packages():
    """A package is a layer: training may use the in-run probes, tune's and diagnose's
    measurements may build a job through training, but never both ways (the loop ran through
    imports inside functions, which a reader of the top-level imports never saw)."""
    graph: dict[str, set[str]] = {}
    for name, targets in _import_graph().items():
        package = _package(name)
        graph.setdefault(package, set()).update(_package(t) for t in targets)
    _assert_no_cycle({name: targets - {name} for name, targets in graph.items()})


def test_no_module_is_over_the_size_limit():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in sorted(lines.items()) if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split along a seam): {over}"


def test_the_cost_model_and_probes_import_no_tensorflow():
    """data.text, tune's output and diagnose's advice predict with them before (or without)
    TensorFlow starting."""
    code = ("import sys; import tfspeed.probes.costs, tfspeed.probes.autotune; "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
