"""labkit's layers point down only (docs/dev/CONTRACTS.md, "Layers"), and its imports have no cycle.

The import graph is read with ast from every module of labkit/, counting imports at module level
AND inside functions (a function-level import is still a dependency: it only hides it), and
`importlib.import_module("labkit....")` with a literal name.
"""

import importlib.util
import ast
import os

from conftest import ROOT

# Lowest first. A module may import modules of its own layer or of a layer below it, never above.
# The longest matching prefix places a module; every module must be placed.
LAYERS = [
    (
        "base",
        [
            "labkit.units",
            "labkit.data",
            "labkit.models",
            "labkit.preset",
            "labkit.observe",
            "labkit.costmodel.links",
            "labkit.costmodel._validate",
        ],
    ),
    ("launch", ["labkit.launch", "labkit"]),  # `labkit` itself: the launcher's names only
    ("comm", ["labkit.comm"]),
    ("strategies", ["labkit.strategies"]),
    ("harness", ["labkit.loop", "labkit.checks", "labkit.exercise", "labkit.costmodel"]),
    ("labs", ["labkit.labs", "labkit.drills", "labkit.cli", "labkit.__main__"]),
]


def _modules():
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "labkit")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph():
    """{module: {labkit modules it imports}} (a `from pkg import name` names pkg.name when that
    is a module, else pkg)."""
    mods = _modules()

    def owner(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("labkit")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = up + ("." + base if base else "")
                if base.startswith("labkit"):
                    deps |= {
                        f"{base}.{a.name}" if f"{base}.{a.name}" in mods else owner(base) for a in node.names
                    }
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("labkit")
            ):
                deps.add(owner(node.args[0].value))
        deps.discard(mod)
        graph[mod] = deps
    return graph


def layer_of(mod):
    best = max(
        (
            (len(p), i)
            for i, (_, prefixes) in enumerate(LAYERS)
            for p in prefixes
            if mod == p or mod.startswith(p + ".")
        ),
        default=None,
    )
    return None if best is None else best[1]


def cycles(graph):
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    unplaced = [m for m in import_graph() if layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS (and CONTRACTS.md): {unplaced}"


def test_imports_point_down_only():
    up = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
        for m, deps in import_graph().items()
        for d in sorted(deps)
        if layer_of(d) is not None and layer_of(m) is not None and layer_of(d) > layer_of(m)
    ]
    assert not up, "imports that point up a layer:\n  " + "\n  ".join(up)


def test_no_import_cycles_counting_function_level_imports():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_checker_sees_a_cycle_and_an_upward_import():
    # The checks above must be able to fail: a made-up graph with both faults.
    graph = {"labkit.comm.a": {"labkit.loop"}, "labkit.loop": {"labkit.comm.a"}}
    assert cycles(graph) == [["labkit.comm.a", "labkit.loop"]]
    assert layer_of("labkit.loop") > layer_of("labkit.comm.a")
    assert layer_of("labkit.costmodel.links") == 0 and layer_of("labkit.costmodel.plot") == 4


def test_no_labkit_function_takes_more_than_8_named_parameters():
    # A function that needs more takes an object (loop.Hooks, costmodel.StepKnobs) instead.
    # *args / **options (forwarded, validated where they land) are not counted; self / cls are not.
    over = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(named) > 8:
                    over.append(f"{mod}.{node.name} (line {node.lineno}): {len(named)}")
    assert not over, "functions over 8 named parameters:\n  " + "\n  ".join(over)


FAMILIES = ("ddp", "zero", "fsdp", "checkpoint", "tp", "cp", "ulysses", "pp", "ep", "three_d")
SHARED = {"__init__.py", "precision.py", "activation_checkpointing.py", "comm_choice.py", "mesh.py"}


def test_strategies_one_folder_per_family_each_init_a_face():
    """strategies/ holds the interface, the shared modules and one folder per family; a family's
    __init__ only imports its modules' names and lists them in __all__ (no code of its own), and
    every name in __all__ is there and defined in the family's modules."""
    import importlib

    root = os.path.join(ROOT, "labkit", "strategies")
    top = {f for f in os.listdir(root) if f.endswith(".py")}
    folders = {f for f in os.listdir(root) if os.path.isdir(os.path.join(root, f)) and f != "__pycache__"}
    assert top == SHARED, f"strategy modules outside a family folder: {sorted(top - SHARED)}"
    assert folders == set(FAMILIES), sorted(folders)
    for family in FAMILIES:
        path = os.path.join(root, family, "__init__.py")
        body = ast.parse(open(path).read()).body
        kinds = {type(node).__name__ for node in body[1:]}  # body[0]: the docstring
        assert isinstance(body[0], ast.Expr) and kinds <= {"ImportFrom", "Assign"}, (family, kinds)
        face = importlib.import_module(f"labkit.strategies.{family}")
        missing = [n for n in face.__all__ if not hasattr(face, n)]
        assert not missing, (family, missing)
        for name in face.__all__:  # a function or class: defined in the family or a shared module
            module = getattr(getattr(face, name), "__module__", None)
            assert module is None or module.startswith(f"labkit.strategies.{family}."), (family, name, module)


def test_public_api_is_small_and_each_name_one_thing():
    """labkit.__all__ stays at 20 names or fewer (topology among them), and `train` is one thing:
    the function labkit.loop.train; the command line is `python -m labkit` (labkit.cli)."""
    import labkit

    assert len(labkit.__all__) <= 20 and "topology" in labkit.__all__, labkit.__all__
    assert "train" not in labkit.__all__ and not hasattr(labkit, "train")
    assert importlib.util.find_spec("labkit.__main__") is not None
