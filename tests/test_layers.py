"""The house plan, checked: upper layers never import a backend module, and the package's
module-level imports form no cycle (docs/architecture.md, "Layers")."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "forge_ml"
UPPER = ["models", "inference", "serve", "train.py", "cli.py"]


def _modules():
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), p


def _imports(name, path, top_level_only):
    """Absolute names of the forge_ml modules ``path`` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("forge_ml"):
                out.add(mod)
                for a in node.names:             # "from . import ops" names a module
                    out.add(f"{mod}.{a.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("forge_ml"))
    return out


def test_upper_layers_import_no_backend():
    bad = []
    for name, path in _modules():
        rel = str(path.relative_to(PKG))
        if any(rel == u or rel.startswith(u + "/") for u in UPPER):
            for mod in _imports(name, path, top_level_only=False):
                if mod.startswith("forge_ml.backends"):
                    bad.append(f"{rel} imports {mod}")
            text = path.read_text(encoding="utf-8")
            if "backend_of" in text:
                bad.append(f"{rel} uses backend_of")
    assert bad == []


def test_upper_layers_ask_capabilities_not_device_types():
    """docs/architecture.md: the upper layers ask ``tensor.device_has(device, ...)``, never
    ``device.type == "cuda"`` (a new backend must not need edits there)."""
    bad = []
    for name, path in _modules():
        rel = str(path.relative_to(PKG))
        if any(rel == u or rel.startswith(u + "/") for u in UPPER):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                        and node.left.attr == "type"
                        and any(isinstance(c, ast.Constant) and c.value in ("cpu", "cuda")
                                for c in ast.walk(node))):
                    bad.append(f"{rel}:{node.lineno} compares a device type")
    assert bad == []


def test_no_import_cycles_at_module_level():
    mods = dict(_modules())
    graph = {n: {m for m in _imports(n, p, top_level_only=True) if m in mods and m != n}
             for n, p in mods.items()}
    # a package's __init__ importing its own submodules is how packages work: drop child edges
    graph = {n: {m for m in deps if not m.startswith(n + ".")} for n, deps in graph.items()}
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []
