"""The layout of common/ (its package docstrings say the same in words): one-way layers and no
import circle. Every module's imports are read with ast, nothing is imported; imports inside
functions and under TYPE_CHECKING count too: they are dependencies whenever they run."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

# Lowest first. A module may import modules of its own package and of lower layers; packages that
# share a layer do not import each other. BASE: the modules at the top of common/.
BASE = "base"
LAYERS = ((BASE,), ("parallel",), ("data", "output"), ("train",), ("use",))
PROGRAMS = ("tests", "bench", "launch")  # with the train_*.py scripts, they stand above common/: it never imports them


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, module: str, is_package: bool, root: Path) -> list[str]:
    """The modules a `from X import a, b` names: X's submodules a and b where they exist, else X."""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    folder = root.joinpath(*base.split("."))
    return [f"{base}.{a.name}" if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir() else base
            for a in node.names]


def imports_of(path: Path, root: Path) -> set[str]:
    module, tree = module_name(path, root), ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(resolve(node, module, path.name == "__init__.py", root))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module under common/ -> what it imports that is ours (common/ or a program beside it)."""
    graph = {}
    for path in sorted((root / "common").rglob("*.py")):
        graph[module_name(path, root)] = {m for m in imports_of(path, root) if is_ours(m)}
    return graph


def is_ours(module: str) -> bool:
    top = module.split(".")[0]
    return top == "common" or top in PROGRAMS or top.startswith("train_")


def package_of(module: str, root: Path) -> str:
    """The subpackage of common/ a module is in, or BASE for the modules at its top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (root / "common" / parts[1]).is_dir() else BASE


def wrong_imports(graph: dict[str, set[str]], root: Path) -> list[str]:
    """Every import that goes up a layer, sideways between packages of one layer, into a package
    no layer names, or out to a program."""
    ranks = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}
    problems = []
    for module, targets in graph.items():
        for target in sorted(targets):
            if not target.startswith("common"):
                problems.append(f"{module} imports the program {target}")
                continue
            mine, theirs = package_of(module, root), package_of(target, root)
            unplaced = [p for p in (mine, theirs) if p not in ranks]
            if unplaced:
                problems.append(f"{module} imports {target}: common/{unplaced[0]}/ is in no layer of LAYERS")
            elif mine != theirs and ranks[theirs] >= ranks[mine]:
                problems.append(f"{module} ({mine}) imports {target} ({theirs}), "
                                f"{'a higher' if ranks[theirs] > ranks[mine] else 'the same'} layer")
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import each other (depth-first search)."""
    found, state, stack = [], {}, []  # state: 1 on the current path, 2 done

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_every_import_under_common_goes_down_the_layers():
    graph = import_graph(ROOT)
    assert len(graph) > 25 and sum(map(len, graph.values())) > 60  # the walk found the modules and their imports
    assert wrong_imports(graph, ROOT) == []


def test_no_import_circle_under_common():
    assert [" -> ".join(c) for c in circles(import_graph(ROOT))] == []


def root_path_edits(path: Path) -> list[int]:
    """Lines that put a folder found from this file's own place (__file__) on sys.path: the way to
    reach the package before it was one. (Putting a script's folder there, as `python SCRIPT`
    does, is not such an edit.)"""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append")
            and any(isinstance(n, ast.Name) and n.id == "__file__" for arg in node.args for n in ast.walk(arg))]


# Folders that the standard Python .gitignore template (github/gitignore Python.gitignore) ignores as
# build output or environments: a package of ours with one of these names vanishes from the commits of
# a contributor who adds that template (common/dist/ did, until it became common/parallel/).
BUILD_OUTPUT_NAMES = {"build", "develop-eggs", "dist", "downloads", "eggs", ".eggs", "lib", "lib64", "parts",
                      "sdist", "var", "wheels", "share", "env", "venv", "ENV", "htmlcov", "site", "target"}


def test_no_folder_of_ours_has_a_name_that_gitignore_templates_drop():
    """Folders that hold a file of ours (a checkout may keep an ignored leftover, e.g. __pycache__)."""
    ours = [p for top in ("common", "tests", "bench", "launch", "docs") for p in (ROOT / top).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".tmp")]
    folders = {parent for p in ours for parent in p.relative_to(ROOT).parents}
    assert sorted(str(f) for f in folders if f.name in BUILD_OUTPUT_NAMES) == []
    assert (ROOT / "common" / "parallel" / "context.py").exists()


def test_tests_launchers_and_scripts_find_the_package_without_editing_sys_path():
    """pytest.ini's pythonpath, PYTHONPATH for the processes the tests start, launch/single_node.sh's
    PYTHONPATH, or `pip install -e .`: never a sys.path edit in the code."""
    files = [*ROOT.glob("train_*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "launch").glob("*.py"),
             *(ROOT / "common").rglob("*.py")]
    assert len(files) > 40
    assert {str(f.relative_to(ROOT)): lines for f in files if (lines := root_path_edits(f))} == {}


@pytest.mark.parametrize("module, line, expected", [
    ("data/loader.py", "from common.train.loop import Loop",
     "common.data.loader (data) imports common.train.loop (train), a higher layer"),
    ("output/log.py", "import common.data.loader",
     "common.output.log (output) imports common.data.loader (data), the same layer"),
    ("config.py", "from common.parallel import net",
     "common.config (base) imports common.parallel.net (parallel), a higher layer"),
    ("parallel/net.py", "from common.extra import thing",
     "common.parallel.net imports common.extra.thing: common/extra/ is in no layer"),
    ("parallel/net.py", "import train_ddp",
     "common.parallel.net imports the program train_ddp"),
], ids=["upward", "sideways", "base-upward", "unplaced-package", "program"])
def test_the_check_finds_a_wrong_import(tmp_path, module, line, expected):
    for name in ("config.py", "data/loader.py", "output/log.py", "parallel/net.py", "train/loop.py", "extra/thing.py"):
        (tmp_path / "common" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "common" / name).touch()
    (tmp_path / "common" / module).write_text(line + "\n")
    problems = wrong_imports(import_graph(tmp_path), tmp_path)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_check_finds_a_circle(tmp_path):
    (tmp_path / "common" / "train").mkdir(parents=True)
    (tmp_path / "common" / "train" / "step.py").write_text("from common.train.strategy import Strategy\n")
    (tmp_path / "common" / "train" / "strategy.py").write_text("def f():\n    from common.train import step\n")
    assert circles(import_graph(tmp_path)) == [["common.train.step", "common.train.strategy", "common.train.step"]]


# The scripts built on common/train/app.py, whose first import is the package (common/collector.py:
# the collector paused before torch loads, its exit handler registered first).
COMMON_FIRST = ("train_ddp.py", "train_allreduce.py", "train_master.py", "train_dp.py", "train_fsdp.py",
                "train_localsgd.py", "train_ft.py")


@pytest.mark.parametrize("script", COMMON_FIRST)
def test_the_scripts_import_the_package_first_and_say_why_where_a_sorter_would_move_it(script):
    lines = (ROOT / script).read_text().splitlines()
    imports = [i for i, line in enumerate(lines) if line.startswith(("import ", "from ")) and "__future__" not in line]
    first = imports[0]
    assert lines[first].startswith("from common"), f"{script}: the first import is {lines[first]!r}"
    assert lines[first + 1] == "# isort: split", f"{script}: no `# isort: split` after the package's import"
    assert "garbage collector" in lines[first - 3] and "collector.py" in lines[first - 2]



BOTH, ALL = ("quick", "quick+slow"), ("quick", "quick+slow", "launch")


@pytest.mark.parametrize("markexpr, given, kept", [
    ("quick", BOTH, {"quick"}), ("quick and not ft", BOTH, {"quick"}), ("(quick)", BOTH, {"quick"}),
    ("slow", ("quick+slow",), {"quick+slow"}), ("quick or slow", BOTH, set(BOTH)),
    ("not quick", ("launch",), {"launch"}), ("", ALL, set(ALL))])
def test_the_quick_tier_leaves_out_the_slow_tests_in_any_expression(markexpr, given, kept):
    """conftest's selection, given what pytest's own kept (it sees a test marked quick and slow as
    quick): `-m "quick and not ft"` took the slow tests in, as only `-m quick` spelt so left them out."""
    from tests.conftest import pytest_collection_modifyitems

    class Item:  # what the hook reads of a collected test: its marks and its file
        def __init__(self, name: str) -> None:
            self.name, self.marks = name, [getattr(pytest.mark, m).mark for m in name.split("+") if m != "launch"]
            self.path = Path("tests/test_x.py")

        def iter_markers(self):
            return iter(self.marks)

        def get_closest_marker(self, name: str):
            return next((m for m in self.marks if m.name == name), None)

    class Hook:
        def __init__(self) -> None:
            self.deselected: list[Item] = []

        def pytest_deselected(self, items: list[Item]) -> None:
            self.deselected += items

    config = SimpleNamespace(getoption={"markexpr": markexpr}.__getitem__, hook=Hook())
    items = [Item(name) for name in given]
    pytest_collection_modifyitems(config, items)
    assert {item.name for item in items} == kept
    assert {item.name for item in config.hook.deselected} == set(given) - kept


@pytest.mark.quick
def test_the_longest_files_are_handed_out_first_and_the_rest_keep_their_order():
    """xdist hands files out in collection order: conftest's LONGEST_FIRST ahead (in its order), the
    others after them as collected, a file's tests in theirs."""
    from tests.conftest import LONGEST_FIRST, pytest_collection_modifyitems

    files = ["test_a.py", LONGEST_FIRST[1], "test_b.py", LONGEST_FIRST[0], "test_a.py", LONGEST_FIRST[1]]
    items = [SimpleNamespace(path=Path("tests") / name, index=i, get_closest_marker=lambda name: None)
             for i, name in enumerate(files)]
    pytest_collection_modifyitems(SimpleNamespace(getoption={"markexpr": ""}.__getitem__), items)
    assert [item.index for item in items] == [3, 1, 5, 0, 2, 4]
