"""The floors of docs/ARCHITECTURE.md, read from its diagram, hold in the code: every import of apmpo that runs (at
module level or inside a function; not under TYPE_CHECKING) goes to a lower floor, or, on the ground floor, to the
same one. A new module must be placed on a floor in the diagram."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "apmpo"


def floors() -> dict[str, int]:
    """{module or package of apmpo: its floor}: each diagram line is a floor number, then the names on it (the words
    that name a module or package of apmpo), then its description; a line without a number goes on the floor above."""
    diagram = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## Floors")[1].split("```")[1]
    found, number = {}, None
    for line in diagram.strip().splitlines():
        first, *words = line.split()
        if first.isdigit():
            number = first
        else:
            words = [first, *words]
        for word in words:
            if not ((PACKAGE / f"{word}.py").is_file() or (PACKAGE / word).is_dir()):
                break
            found[word] = int(number)
    return found


def runtime_imports(source: str) -> list[str]:
    """The modules that `source` imports when it runs."""
    tree = ast.parse(source)
    typing_only = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(branch.test) for stmt in branch.body for node in ast.walk(stmt)}
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "apmpo":  # from apmpo import warm
                names += [f"apmpo.{alias.name}" for alias in node.names]
    return names


def unit(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_every_module_of_the_package_is_on_a_floor():
    units = {unit(path) for path in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert units - floors().keys() == set()


def test_imports_go_down_the_floors():
    floor = floors()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = unit(path)
        if importer not in floor:
            continue
        for name in runtime_imports(path.read_text()):
            imported = name.split(".")[1] if re.match(r"apmpo\.\w", name) else None
            if imported is None or imported == importer:
                continue
            if floor[imported] > floor[importer] or floor[imported] == floor[importer] > 0:
                upward.append(f"{path.relative_to(ROOT)} (floor {floor[importer]}) imports {name} "
                              f"(floor {floor[imported]})")
    assert upward == []


def test_an_import_that_runs_back_up_is_found():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from apmpo.learner import step\n"
              "def f():\n    from apmpo.study import stats\n")
    assert runtime_imports(source) == ["typing", "apmpo.study"]
