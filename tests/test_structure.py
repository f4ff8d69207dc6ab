"""The import structure: the top level holds the commands and the learner's files, every other module sits in
the folder of its layer, imports run one way between the layers, no circle, and the plain definitions in
model.py unaware of the fast paths. Every import counts, also one inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = {"train", "eval", "experiments", "merge", "advantage", "model", "verifier"}
FOLDERS = ("infra", "fast", "loop", "study")  # a package each: what it holds, what it may import
MODULES = ({path.stem: path for path in ROOT.glob("*.py")} | {"data.tasks": ROOT / "data" / "tasks.py"}
           | {f"{folder}.{path.stem}": path for folder in FOLDERS for path in (ROOT / folder).glob("*.py")
              if path.stem != "__init__"})


def imports_of(path: Path) -> set[str]:
    """The project's modules that `path` imports anywhere in its text (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports as [a, b, ..., a], or None: depth-first, a module met again on the current path
    closes one."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


# plain <- fast paths <- the loop <- scripts <- study: a module imports only modules of its layer or below. A
# folder's modules sit in its layer; a top-level file sits in the layer beside the folder it is named with.
LAYERS = {
    "plain": {"infra", "data", "advantage", "model", "verifier"},
    "fast": {"fast"},
    "loop": {"loop", "eval"},
    "scripts": {"train", "merge"},
    "study": {"study", "experiments"},
}
RANK = {place: i for i, places in enumerate(LAYERS.values()) for place in places}


def layer(module: str) -> int:
    """The layer of `infra.hardware` (its folder's), or of a top-level file."""
    return RANK[module.split(".")[0]]


def test_the_top_level_holds_the_commands_and_the_learners_files_and_each_folder_says_what_it_is():
    assert {path.stem for path in ROOT.glob("*.py")} == TOP_LEVEL
    assert {path.parent.name for path in ROOT.glob("*/__init__.py")} == {*FOLDERS, "data"}
    assert set(FOLDERS) <= set(RANK)
    for folder in FOLDERS:
        said = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        assert said and "import" in said.lower(), f"{folder}/__init__.py: what it holds, what it may import"


def test_the_layers_import_in_one_direction():
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    assert {module.split(".")[0] for module in graph} <= set(RANK), "a new folder: put it in a layer"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    for module, imported in graph.items():
        for other in imported:
            assert layer(other) <= layer(module), f"{module} imports {other}, of a layer above"


# The study's rooms, in the one order in which each may import only those before it (issue 73): beneath them
# the statistics and the worker processes, which import no room; then the flags, parsed once into the one
# Namespace the later rooms read; the runs; which runs each part trains; the plan of their time (it trains the
# calibration through the workers); the tables and the report. experiments.py drives them all.
ROOMS = ("study.stats", "study.workers", "study.flags", "study.runs", "study.parts", "study.plan",
         "study.tables")


def defined(module: str) -> set[str]:
    """The functions and classes that `module` defines at its top level."""
    return {node.name for node in ast.parse(MODULES[module].read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_study_flows_one_way():
    assert {module for module in MODULES if module.startswith("study.")} == set(ROOMS), "a new room: order it"
    for i, room in enumerate(ROOMS):
        assert not imports_of(MODULES[room]) & set(ROOMS[i + 1:]), f"{room} imports a room after it"
    for room in ROOMS:  # only experiments.py parses the flags; the rooms read what it parsed
        tree = ast.parse(MODULES[room].read_text())
        assert not any(isinstance(node, ast.ImportFrom) and node.module == "study.flags"
                       and "parse_args" in {alias.name for alias in node.names} for node in ast.walk(tree))
    which, how_long = defined("study.parts"), defined("study.plan")  # two rooms, one concern each
    assert {"planned_runs", "scatter_runs", "precision_runs", "sweep_runs"} <= which
    assert {"calibrate", "run_seconds", "study_plan", "fit_budget", "print_plan", "interval_plan"} <= how_long


def test_each_file_says_first_what_it_holds_and_stays_short():
    """issue 51's budget: train.py within 350 lines, the learner's three files within 1,000, any other file
    within ~400 but the verifier's tables and the experiments' driver; each file's docstring opens it."""
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert lines["train"] <= 350
    assert lines["advantage"] + lines["train"] + lines["model"] <= 1000
    assert all(n <= 400 for name, n in lines.items() if name != "verifier"), lines
    for path in MODULES.values():
        first = ast.get_docstring(ast.parse(path.read_text()))
        assert first and len(first.splitlines()[0]) > 20, path
    body = ast.parse(MODULES["model"].read_text()).body
    first_function = next(node.name for node in body if isinstance(node, ast.FunctionDef))
    assert first_function == "model_source", "model.py opens with loading"


def test_the_plain_definitions_know_no_fast_path():
    assert not imports_of(MODULES["model"]) & {"fast.decoding", "fast.packing", "loop.run", "train"}
    assert {"model"} <= imports_of(MODULES["fast.decoding"]) <= {"model", "infra.lora"}  # on the plain ones
    assert imports_of(MODULES["fast.packing"]) <= {"model", "fast.decoding"}


def test_find_cycle_finds_a_circle_and_only_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no circle
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_product_names_no_folder_outside_the_repository():
    """The shared folder beside the development checkout is not a user's: the product (the top-level files,
    the folders, data/, benchmarks/, the README, docs/) never points at it; tests may, to skip without it."""
    product = [*MODULES.values(), *ROOT.glob("data/*.py"), *ROOT.glob("benchmarks/*.py"), ROOT / "README.md",
               *ROOT.glob("docs/*.md")]
    assert len(product) > 20
    for path in product:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and '"shared"' not in text, path  # a path, or a Path's part
