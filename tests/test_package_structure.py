"""The package's structure, read from its source (imports and definitions, nothing imported): product code never
imports the tests or the benchmarks, the modules import each other without a circle, and process-wide mutable state
says why it is process-wide."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: checkout folder -> import name (pyproject.toml's package-dir)
PACKAGES = {"bdlora": "bdlora", "train": "bdlora.train", "vllm_plugin": "bdlora.vllm_plugin"}
MUTABLE_CALLS = {"Counter", "defaultdict", "dict", "list", "set", "OrderedDict", "WeakValueDictionary",
                 "WeakKeyDictionary", "local", "Lock", "RLock"}


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every package module."""
    out = {}
    for folder, name in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = f
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The modules ``module`` imports (absolute names; relative imports resolved), at any depth of its code."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return found


def test_product_code_never_imports_tests_or_bench():
    bad = [f"{m}: {i}" for m, p in _modules().items() for i in _imports(m, p)
           if i.split(".")[0] in ("tests", "bench") or i in ("conftest",)]
    assert not bad, bad


def test_no_import_circle_between_modules():
    """Module-level imports only (a function's lazy import breaks no circle at import time, but two modules that
    need each other are still one concept split in two: those are counted too, except package ``__init__`` files,
    which re-export)."""
    modules = _modules()
    graph = {m: {i for i in _imports(m, p) if i in modules and i != m} for m, p in modules.items()
             if p.name != "__init__.py"}
    for deps in graph.values():
        deps -= {m for m, p in modules.items() if p.name == "__init__.py"}
    seen, on_stack, cycles = set(), [], []

    def visit(m):
        if m in on_stack:
            cycles.append(on_stack[on_stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_stack.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        on_stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


def test_process_wide_state_says_why():
    """A module-level name that holds mutable state (a lower-case name bound to a container, a lock or thread-local
    storage, or any name a function rebinds with ``global``) has a comment beside it or on the lines just above.
    UPPER_CASE containers are constants by convention and are left alone."""
    missing = []
    for module, path in _modules().items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            value = node.value
            call = value.func if isinstance(value, ast.Call) else None
            call_name = getattr(call, "id", getattr(call, "attr", None))
            container = isinstance(value, (ast.Dict, ast.List, ast.Set)) or call_name in MUTABLE_CALLS
            stateful = [n for n in names if n in rebound or (container and not n.lstrip("_").isupper()
                                                              and n != "__all__")]
            if not stateful:
                continue
            here = lines[node.lineno - 1]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if "#" not in here and not above.startswith("#"):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()[:80]}")
    assert not missing, "\n".join(missing)


def test_every_package_folder_and_data_file_is_installed():
    """pyproject.toml lists every package folder and ships every non-Python file a package reads, so a wheel
    (``pip install .``, not only the editable install the tests run on) has the whole product."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {".".join([name, *f.parent.relative_to(ROOT / folder).parts])
               for folder, name in PACKAGES.items() for f in (ROOT / folder).rglob("__init__.py")}
    assert folders - listed == set(), "package folders missing from pyproject.toml's packages"
    data = tool.get("package-data", {})
    for folder, name in PACKAGES.items():
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and f.suffix in (".json", ".yaml", ".jsonl", ".txt") and "__pycache__" not in f.parts:
                pkg = ".".join([name, *f.parent.relative_to(ROOT / folder).parts])
                while pkg not in listed:
                    pkg = pkg.rsplit(".", 1)[0]
                rel = f.relative_to(ROOT / folder / Path(*pkg.split(".")[len(name.split(".")):]))
                assert any(rel.match(g) for g in data.get(pkg, [])), f"{f} is not in package-data of {pkg}"
