"""The import direction of the package: the modeling code (shipped alone as remote code) imports nothing else of
the package, the trainers only the modeling code and the card renderer, and no module of ours imports itself
through others. Every import counts, also those inside functions."""

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Folder -> installed package, as pyproject.toml's `package-dir` maps them.
PACKAGES = {
    "hf_earlyexit": REPO / "hf_earlyexit",
    "hf_earlyexit.modeling": REPO / "modeling",
    "hf_earlyexit.trainers": REPO / "trainers",
    "hf_earlyexit.model_cards": REPO / "model_cards",
}
# Copies (symlinks) of modeling files, shipped as the embedded model's remote code.
SKIPPED = (REPO / "hf_earlyexit" / "embedded_model",)


def own_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of our packages (a package's name for its __init__.py)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if any(path.is_relative_to(skipped) for skipped in SKIPPED):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(absolute module, names imported from it) for every import statement of `module`, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            yield target, tuple(alias.name for alias in node.names)


def dependencies(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> our modules it imports. `from pkg import name` depends on `pkg.name` when that is a module, else
    on `pkg` (its __init__); a package's parents, which Python imports on the way, are not counted."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for target, names in imported_names(module, path):
            submodules = {f"{target}.{name}" for name in names} & modules.keys()
            if len(submodules) < len(names) or not names:
                submodules.add(target)
            graph[module] |= {dependency for dependency in submodules if dependency in modules} - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the search path, "done" once all its imports are explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                return [*path[path.index(dependency) :], dependency]
            if dependency not in state and (cycle := visit(dependency)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


GRAPH = dependencies(own_modules())


def outside(prefixes: tuple[str, ...], part: str) -> dict[str, list[str]]:
    """For each module of `part`, the modules it imports that are neither in `part` nor under `prefixes`."""
    allowed = (part, *prefixes)
    found = {
        module: sorted(d for d in dependencies if not any(d == p or d.startswith(f"{p}.") for p in allowed))
        for module, dependencies in GRAPH.items()
        if module == part or module.startswith(f"{part}.")
    }
    return {module: wrong for module, wrong in found.items() if wrong}


def test_every_package_is_found_and_imports_resolve_to_modules():
    assert {"hf_earlyexit", "hf_earlyexit.cli", "hf_earlyexit.modeling.modeling_ofa"} <= GRAPH.keys()
    assert "hf_earlyexit.trainers.early_exit_trainer" in GRAPH and "hf_earlyexit.model_cards" in GRAPH
    assert not any(module.startswith("hf_earlyexit.embedded_model") for module in GRAPH)
    # The resolution itself: relative imports, `from . import submodule`, and `from pkg import name` as `pkg`.
    assert "hf_earlyexit.modeling.exit_knobs" in GRAPH["hf_earlyexit.modeling.configuration_ofa"]
    assert "hf_earlyexit.model_cards" in GRAPH["hf_earlyexit.trainers.early_exit_trainer"]
    assert "hf_earlyexit.modeling" in GRAPH["hf_earlyexit"]


def test_the_dependency_rules_of_the_resolver(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\nfrom .a import thing\n")
    (package / "a.py").write_text("def f():\n    from .sub import b, helper\n")
    (package / "sub" / "__init__.py").write_text("from .. import a\n")
    (package / "sub" / "b.py").write_text("import pkg.a\nfrom pkg import VERSION\n")
    modules = {"pkg": package / "__init__.py", "pkg.a": package / "a.py", "pkg.sub": package / "sub" / "__init__.py"}
    modules["pkg.sub.b"] = package / "sub" / "b.py"
    graph = dependencies(modules)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub", "pkg.sub.b"},
        "pkg.sub": {"pkg.a"},
        "pkg.sub.b": {"pkg.a", "pkg"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.sub", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_the_modeling_code_imports_nothing_else_of_the_package():
    # It ships alone as a model's remote code, where the rest of the package is absent.
    assert outside((), "hf_earlyexit.modeling") == {}


def test_the_trainers_import_only_the_modeling_code_and_the_card_renderer():
    assert outside(("hf_earlyexit.modeling", "hf_earlyexit.model_cards"), "hf_earlyexit.trainers") == {}


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
