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


# ------------------------------------------------------------------------------------------------
# Fitness tests of the architecture: import direction, no cycles, the server's boundary, sizes
# ------------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Which modules of ``uhead_vllm`` each module imports: every import statement, at module level,
    under ``if TYPE_CHECKING`` and inside functions alike (those are the ones that hide a cycle).
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    modules = {_module_name(p): p for p in _library_modules()}

    def owner(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{name}.{a.name}" if f"{name}.{a.name}" in modules else owner(name) for a in node.names}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_the_package() -> None:
    """No module reaches itself through imports, however long the way (function-level and
    ``TYPE_CHECKING`` imports included: a cycle deferred into a function is still a cycle)."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: The architecture's floors, bottom to top (a top-level module or package of ``uhead_vllm`` each;
#: "" is the package's public names, ``uhead_vllm/__init__.py``). A module imports from its own
#: floor or below, never from above. The CLI is the top: it assembles the product's commands and
#: registers the study's; the study builds on everything else and imports nothing of the CLI's
#: (the options both use live in ``cli_args``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "envs", "runtime"),
    ("adapters",),
    ("capture",),
    ("features", "client"),
    ("generation",),
    ("heads", "metrics", "models", "scaleout", "_testing", "_testing_dsv4"),
    ("scoring",),
    ("polygraph", "thinkbooster", "serving", "tasks", "cli_args"),
    ("study",),
    ("cli", ""),
)

#: Upward imports the architecture allows, each with its reason.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("uhead_vllm.adapters.server", "uhead_vllm.capture.protocol"):
        "vLLM's OpenAI-server adapter tags the children of an n>1 request with the wire type "
        "RequestTag: plain data of the one typed interface, no worker code",
}


def _room(module: str) -> str:
    """The top-level module or package of ``uhead_vllm`` a module belongs to ("" for the package)."""
    return module.split(".")[1] if "." in module else ""


def test_every_room_of_the_package_is_on_one_floor() -> None:
    rooms = [r for floor in FLOORS for r in floor]
    assert len(rooms) == len(set(rooms))
    assert {_room(m) for m in _module_graph()} == set(rooms)


def test_no_upward_import_inside_the_package() -> None:
    """Imports go down the floors of :data:`FLOORS` (or stay on one), wherever they are written."""
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    graph = _module_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if floor[_room(t)] > floor[_room(m)] and (m, t) not in UPWARD_EXCEPTIONS)
    assert upward == []
    assert [pair for pair in UPWARD_EXCEPTIONS if pair[1] not in graph.get(pair[0], ())] == []  # none stale


def test_the_server_uses_no_completion_internals() -> None:
    """The server gets complete rows through the generation's public face, never from the prefix
    store or the completion's row assembly directly (the generator and the server share one path)."""
    internals = {"uhead_vllm.generation.prefix_store", "uhead_vllm.generation.assembly"}
    users = sorted(f"{m} -> {t}" for m, targets in _module_graph().items() if m.startswith("uhead_vllm.serving")
                   for t in targets & internals)
    assert users == []


#: Line limits of modules that grew several jobs before they were split.
SIZE_LIMITS = {"capture/protocol.py": 200, "generation/generator.py": 250}


def test_split_modules_stay_small() -> None:
    sizes = {name: len((PACKAGE / name).read_text().splitlines()) for name in SIZE_LIMITS}
    assert {name: n for name, n in sizes.items() if n > SIZE_LIMITS[name]} == {}
