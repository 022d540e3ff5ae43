"""The package's public seams: code outside the kernels package uses `fastrehearse.kernels`' public
API only (its private modules may change with any kernel revision), checked on the source's
import statements, function-local imports included."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_no_private_kernel_module_is_imported_outside_the_kernels():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / "fastrehearse").rglob("*.py"))
           for m in _imports(p) if m.startswith("fastrehearse.kernels._")]
    assert bad == []


def test_the_check_finds_a_private_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from fastrehearse.kernels._common import BACKENDS\n")
    assert "fastrehearse.kernels._common" in _imports(f)


def _module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, kernels included (module level, TYPE_CHECKING blocks and
    function-local imports alike: a cycle hidden by any of them is still a cycle). `from pkg import
    name` points at pkg.name when that is a module, else at pkg itself."""
    mods = {}
    # kernels/ is installed as fastrehearse.kernels (setup.py's package_dir): one package, one graph
    for root, name in ((ROOT / "fastrehearse", ("fastrehearse",)), (ROOT / "kernels", ("fastrehearse", "kernels"))):
        for p in root.rglob("*.py"):
            parts = name + p.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                for a in node.names:
                    t = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if t in mods and t != m:
                        graph[m].add(t)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop(); on.discard(x); comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_in_the_package():
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
