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
