"""Imports run one way: down the README's Layout table, never up it."""
import ast
import re

from helpers import ROOT

PACKAGE = "megatron_adacc"


def layers() -> list[list[str]]:
    """The paths in each row of the README's Layout table, top row first."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout"):].split("\n\n")[2]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    return [re.findall(r"`([^`]+)`", row) for row in rows]


def layer_of(path: str, rows: list[list[str]]) -> int | None:
    """The row whose path names ``path`` (a file, or a folder holding it), longest first."""
    matches = [(len(entry), index) for index, row in enumerate(rows) for entry in row
               if path == entry or (entry.endswith("/") and path.startswith(entry))]
    return max(matches)[1] if matches else None


def module_path(module: str) -> str:
    """``megatron_adacc.planning.analytic`` as a repository path, a package as its folder."""
    relative = module.replace(".", "/")
    return relative + "/" if (ROOT / relative).is_dir() else relative + ".py"


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import of this package's modules, in functions too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from megatron_adacc import codecs` imports the module megatron_adacc.codecs
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if (ROOT / module_path(f"{node.module}.{alias.name}")).exists()]
    return [(line, name) for line, name in found
            if name.startswith(PACKAGE + ".") or name == "pretrain_gpt"]


def test_every_module_has_a_row_in_the_layout_table():
    rows = layers()
    files = [str(path.relative_to(ROOT)) for path in (ROOT / PACKAGE).rglob("*.py")]
    assert [f for f in files if layer_of(f, rows) is None
            and f != f"{PACKAGE}/__init__.py"] == []


def test_no_module_imports_one_above_it_in_the_layout_table():
    rows = layers()
    upward = []
    sources = [*(ROOT / PACKAGE).rglob("*.py"), ROOT / "pretrain_gpt.py"]
    for source in sources:
        path = str(source.relative_to(ROOT))
        if path == f"{PACKAGE}/__init__.py":  # re-exports Adacc lazily, on first use
            continue
        own = layer_of(path, rows)
        for line, module in imported_modules(ast.parse(source.read_text())):
            target = layer_of(module_path(module), rows)
            if target is not None and target < own:
                upward.append(f"{path}:{line} imports {module} (row {target + 1}, "
                              f"above its own row {own + 1})")
    assert upward == []


def test_the_walk_sees_an_upward_import():
    # The check itself: a planning module importing the profiler would be caught.
    rows = layers()
    tree = ast.parse("def f():\n    from megatron_adacc.profiling import profiler\n")
    (line, module), *_ = [m for m in imported_modules(tree) if m[1].endswith("profiler")]
    assert layer_of(module_path(module), rows) < layer_of(f"{PACKAGE}/planning/model.py", rows)
