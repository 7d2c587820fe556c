"""Loading an implementation from a spec (FILE.py:function, module:function or a built-in's name),
and where each loaded one came from, so a reproducer can load it again from anywhere."""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

from flashcheck.contract import REGISTRY, ContractError, Implementation

ORIGINS: dict[str, dict] = {}  # implementation name -> where it was loaded from (see ``origin_of``)


def load(spec: str) -> Implementation:
    """Import ``path/to/file.py:function`` or ``package.module:function`` and return its record.

    A bare name selects a built-in implementation (``--impl torch-tiled``).
    """
    if ":" not in spec and not spec.endswith(".py"):
        return _builtin(spec)
    target, sep, attr = spec.rpartition(":")
    if spec.endswith(".py") and not sep:
        found = _decorated(Path(spec))
        raise ContractError(f"--impl {spec!r}: expected FILE.py:function, e.g. {spec}:{found[0] if found else 'FUNCTION'}"
                            f" (decorated with @implementation in it: {', '.join(found) or 'none found'})")
    if not sep or not target or not attr:
        raise ContractError(f"--impl {spec!r}: expected FILE.py:function, module:function or a built-in name")
    # as `python -m pytest` and `python my_attn.py` would have it, whichever command started the run:
    # a module name resolves from the current directory, and a plug-in imports the files beside it
    _on_path(Path.cwd())
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise ContractError(f"--impl {spec!r}: no such file {path}")
        _on_path(path.parent)
        mod_name = f"flashcheck_plugin_{path.stem}_{abs(hash(str(path)))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise ContractError(f"--impl {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ContractError(f"--impl {spec!r}: cannot import module {target!r}: "
                                f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ContractError(f"--impl {spec!r}: module {target!r} has no attribute {attr!r}")
    record = getattr(fn, "__flashcheck__", None)
    if record is None:
        raise ContractError(f"--impl {spec!r}: {attr!r} is not decorated with @flashcheck.implementation(...)")
    ORIGINS[record.name] = _origin(module, attr)
    return record


def _on_path(folder: Path) -> None:
    entry = str(folder.resolve())
    if entry not in (str(Path(p or ".").resolve()) for p in sys.path):
        sys.path.append(entry)  # after site-packages: a plug-in named like a package it imports (mutants/triton.py) must not shadow it


def _origin(module, attr: str) -> dict:
    """Where a loaded implementation lives, absolute, so it can be loaded again from any directory."""
    path = Path(getattr(module, "__file__", "") or "").resolve()
    origin = {"spec": f"{path}:{attr}", "path": str(path), "function": attr, "module": None, "root": None}
    if not module.__name__.startswith("flashcheck_plugin_"):  # imported by module name, not by file
        depth = module.__name__.count(".") + (path.name == "__init__.py")
        origin.update(spec=f"{module.__name__}:{attr}", module=module.__name__, root=str(path.parents[depth]))
    return origin


def _decorated(path: Path) -> list[str]:
    """Functions that look decorated with @implementation in a file, for a hint (read, not imported)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    # a decorator block: lines from "@...implementation(" down to the "def" it decorates
    return re.findall(r"^@[\w.]*implementation\((?:.|\n)*?^def (\w+)", text, re.M)


def origin_of(impl: Implementation) -> dict:
    """Where ``impl`` came from: an absolute ``spec`` that loads it from any directory, the file
    ``path``, and for module specs the ``module`` name and the sys.path ``root`` it imports from."""
    return ORIGINS.get(impl.name) or {"spec": impl.name, "path": None, "function": None, "module": None,
                                      "root": None}


def _builtin(name: str) -> Implementation:
    """A built-in by name, importing only its own module."""
    from flashcheck.impls import builtin

    loaded, why = builtin.load(name)
    if loaded and name in REGISTRY:
        return REGISTRY[name]
    if why:
        raise ContractError(f"--impl {name!r}: the built-in is unavailable here: {why}")
    every = ", ".join(n for _, names in builtin.MODULES for n in names)
    raise ContractError(f"--impl {name!r}: not a built-in implementation ({every}); "
                        "expected FILE.py:function, module:function or a built-in name")


def builtins() -> list[Implementation]:
    """The built-in implementations whose dependencies import here."""
    from flashcheck.impls import builtin  # noqa: F401  (registers on import)
    return [REGISTRY[name] for name in builtin.NAMES if name in REGISTRY]
