"""The layout says where code goes: the product never imports the research pipeline, the library
never imports the test models, ``estimators/`` and ``configs/`` hold only thin forwards, and the
README's layout table names every top-level module and package of ``uhead_vllm``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "uhead_vllm"


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def _library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_product_never_imports_the_research_pipeline() -> None:
    """Only the study itself and the CLI (which registers the study's commands) import it."""
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("uhead_vllm.study"))
                 for p in _library_modules()
                 if "study" not in p.relative_to(PACKAGE).parts and p.name != "cli.py"}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_library_never_imports_the_tiny_test_models() -> None:
    """``uhead_vllm._testing*`` are for tests and benchmarks, never imported by the library itself."""
    users = [str(p.relative_to(ROOT)) for p in _library_modules()
             if not p.name.startswith("_testing") and any(n.startswith("uhead_vllm._testing") for n in _imports(p))]
    assert users == []


def _thin(path: Path) -> list[str]:
    """What in ``path`` is more than a docstring, imports, ``__all__`` and one-statement functions."""
    extra = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        if isinstance(node, ast.FunctionDef):
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Return):
                continue
        extra.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return extra


def test_estimators_and_configs_hold_only_thin_forwards() -> None:
    files = sorted((ROOT / "estimators").glob("*.py")) + sorted((ROOT / "configs").rglob("*.py"))
    assert len(files) >= 8
    assert [x for f in files for x in _thin(f)] == []


def test_readme_layout_table_names_every_top_level_module() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    named = {re.sub(r"^uhead_vllm/", "", n).rstrip("/") for cell in first_cells for n in re.findall(r"`([^`]+)`", cell)}
    for name in named:
        if "/" in name or name.endswith(".py"):
            assert (PACKAGE / name).exists() or (ROOT / name).exists(), name
    children = {p.name if p.is_dir() else p.name for p in PACKAGE.iterdir()
                if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert children - named == set()


def test_every_error_class_lives_in_errors_py_and_derives_from_uhead_error() -> None:
    """One place for errors (as scikit-learn's ``exceptions.py``): a class named ``*Error`` or
    deriving from an exception is defined in ``uhead_vllm/errors.py`` only, and every one there
    derives from ``UheadError``."""
    import inspect

    import uhead_vllm.errors as errors

    elsewhere = []
    for path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [ast.unparse(b) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and (node.name.endswith(("Error", "Exception"))
                                                   or any(b.endswith(("Error", "Exception")) for b in bases)):
                if path.name != "errors.py":
                    elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert elsewhere == []
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 20
    assert [c.__name__ for c in classes if not issubclass(c, errors.UheadError)] == []


def test_environment_variables_are_read_in_envs_py_only() -> None:
    """Every variable of the package's own is named and read in ``uhead_vllm/envs.py`` (as
    ``vllm/envs.py``); elsewhere ``os.environ`` only sets other programs' defaults (vLLM, torch)."""
    readers = []
    for path in _library_modules():
        if path.name == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("UHEAD"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert readers == []
