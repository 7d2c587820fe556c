"""Each file of the tree has one module name (docs/design.md, "One name per file")."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("impls", "strategies", "properties")  # flashcheck/<name> -> ../<name>
SKIP = {"scratch", "build", ".git", ".tox", ".venv", "reproducers"}


def _sources():
    """Every Python file once: the linked folders are read at the top, not again through the links."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if not SKIP & set(rel) and rel[:2] not in [("flashcheck", n) for n in LINKED]:
            yield path


def _file_of(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def _imported(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_every_import_in_the_tree_names_each_file_by_one_module_name():
    names: dict[Path, set[str]] = {}
    for path in _sources():
        for name in _imported(path):
            if name.split(".")[0] in LINKED:
                raise AssertionError(f"{path.relative_to(ROOT)} imports {name!r}: the linked folders are "
                                     f"imported as flashcheck.{name}")
            file = _file_of(name)
            if file is not None:
                names.setdefault(file, set()).add(name)
    assert len(names) > 40, f"the scan resolved only {len(names)} files: it is not reading the tree"
    twice = {str(f.relative_to(ROOT)): sorted(n) for f, n in names.items() if len(n) > 1}
    assert not twice, f"files imported under two module names: {twice}"


def test_every_module_loaded_in_this_run_from_the_tree_has_one_name():
    names: dict[Path, set[str]] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(ROOT):
            names.setdefault(Path(file).resolve(), set()).add(name)
    assert any(f.parent.name == "properties" for f in names), "no kernel property module is loaded"
    twice = {str(f.relative_to(ROOT)): sorted(n) for f, n in names.items() if len(n) > 1}
    assert not twice, f"files loaded under two module names: {twice}"


def test_the_wheel_lists_every_package_of_the_tree():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flashcheck").rglob("__init__.py")}
    found |= {f"flashcheck.{n}" for n in LINKED}  # rglob does not follow the links
    assert found == listed, f"pyproject.toml lists {sorted(listed)}; the tree has {sorted(found)}"
