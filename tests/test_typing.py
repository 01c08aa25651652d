"""Public functions carry type hints: every function and method whose name does not start with _
(methods of classes whose name does not either) in labkit/strategies, labkit/comm,
labkit/launch and labkit/loop.py annotates every argument (self / cls aside) and its return. Read with ast, not
imported. mypy (make lint, pyproject.toml's [tool.mypy]) checks that the hints hold."""

import ast
import os

from conftest import ROOT

PACKAGES = ("labkit/strategies", "labkit/comm", "labkit/launch", "labkit/loop.py")
# Files whose hints another change brings; remove each from here once it has them.
NOT_YET: set[str] = set()


def _unannotated(path):
    """'line name (what is missing)' for each public function of `path` lacking a hint."""
    out = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                a = node.args
                args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
                if prefix and args and args[0].arg in ("self", "cls"):
                    args = args[1:]
                missing = [x.arg for x in args if x.annotation is None]
                if node.returns is None:
                    missing.append("return")
                if missing:
                    out.append(f"{node.lineno} {prefix}{node.name} ({', '.join(missing)})")

    visit(ast.parse(open(path).read(), path).body, "")
    return out


def _files():
    paths = []
    for package in PACKAGES:
        if package.endswith(".py"):
            paths.append(package)
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            paths += [
                os.path.relpath(os.path.join(folder, f), ROOT) for f in sorted(files) if f.endswith(".py")
            ]
    for rel in (p.replace(os.sep, "/") for p in paths):
        if not any(rel == n or rel.startswith(n + "/") for n in NOT_YET):
            yield rel


def test_public_functions_are_annotated():
    missing = [f"{rel}:{line}" for rel in _files() for line in _unannotated(os.path.join(ROOT, rel))]
    assert not missing, f"{len(missing)} public function(s) without full type hints:\n  " + "\n  ".join(
        missing
    )


def test_the_checker_sees_a_missing_hint(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "def ok(x: int) -> int: ...\n"
        "def _private(x): ...\n"
        "class Public:\n"
        "    def method(self, y) -> None: ...\n"
        "    def _helper(self, z): ...\n"
        "class _Private:\n"
        "    def method(self, w): ...\n"
        "def no_return(x: int): ...\n"
    )
    assert _unannotated(str(path)) == ["4 Public.method (y)", "8 no_return (return)"]
