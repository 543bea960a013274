"""The package's imports form no circle, and it imports nothing of the repository's launch/ or scripts/ (they sit above
it). Read from every module of apmpo/ with ast, every import of apmpo counts: at module level, inside a function, or
under TYPE_CHECKING (a circle the type checker alone sees is still two rooms that each need the other; the types they
share go into a module below both, docs/ARCHITECTURE.md "Floors"). tests/test_floors.py checks the floors themselves."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "apmpo"


def modules(package: Path) -> dict[str, Path]:
    """{dotted name: file} of every module under `package`, a package under the name of its __init__.py."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path) -> set[str]:
    """The dotted names module `name` (at `path`) imports anywhere in it; `from a.b import c` gives a.b.c as well
    as a.b (c may be a module), relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join([*package[:len(package) - node.level + 1], node.module or ""] if node.level
                            else [node.module]).strip(".")
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports, itself left out}."""
    known = modules(package)
    return {name: (imported(name, path) & known.keys()) - {name} for name, path in known.items()}


def first_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of `graph` as its path, [a, b, ..., a], or None (depth first; a module whose imports are all
    explored is done)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for child in sorted(graph[node]):
            if circle := visit(child, [*path, node]):
                return circle
        done.add(node)
        return None

    return next((circle for node in sorted(graph) if (circle := visit(node, []))), None)


def test_the_package_imports_form_no_circle():
    assert first_circle(import_graph(PACKAGE)) is None


def test_the_package_imports_nothing_of_launch_or_scripts():
    upward = [f"{path.relative_to(ROOT)} imports {name}" for name, path in modules(PACKAGE).items()
              for name in imported(name, path) if name.split(".")[0] in ("launch", "scripts")]
    assert upward == []


def test_a_circle_through_a_function_or_type_checking_is_found(tmp_path):
    # pkg/a.py imports pkg.b inside a function; pkg/b.py takes a type from pkg.c under TYPE_CHECKING; pkg/c.py imports
    # a relatively (from . import a): a -> b -> c -> a. pkg/d.py only imports a, and is in no circle.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import T\n")
    (pkg / "c.py").write_text("from . import a\nT = int\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg", "pkg.a"},
                     "pkg.d": {"pkg.a"}}
    assert first_circle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("T = int\n")
    assert first_circle(import_graph(pkg)) is None
