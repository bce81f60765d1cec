"""The planner runs on a `Layout` and a `ModelConfig`, never on the whole `Config`: no
function or method in `tetrad.plan` takes one (`plan/cli.py` builds the Layout at the edge,
through `plan.candidates.layout_for`)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import tetrad.plan
from tetrad.config import Config


def _modules() -> list:
    names = [m.name for m in pkgutil.iter_modules(tetrad.plan.__path__)]
    return [importlib.import_module(f"tetrad.plan.{name}") for name in sorted(names)]


def _callables(module) -> list:
    """The module's own functions, and the methods of its own classes."""
    out = []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            out.append(obj)
        elif inspect.isclass(obj):
            out += [f for f in vars(obj).values() if inspect.isfunction(f)]
            out += [p.fget for p in vars(obj).values() if isinstance(p, property)]
    return out


def _takes_config(hint) -> bool:
    return hint is Config or any(_takes_config(a) for a in typing.get_args(hint))


def test_no_plan_function_takes_a_config():
    """Every parameter of every function and method of `tetrad.plan`, resolved."""
    offenders, checked = [], 0
    for module in _modules():
        for fn in _callables(module):
            checked += 1
            hints = typing.get_type_hints(fn)
            params = inspect.signature(fn).parameters
            bad = [p for p in params if p in hints and _takes_config(hints[p])]
            offenders += [f"{module.__name__}.{fn.__qualname__}({p})" for p in bad]
    assert checked > 100
    assert not offenders, f"take a Config: {offenders}"


def test_no_plan_source_annotates_a_config():
    """The same by the sources, nested functions and lambdas' neighbours included: no
    parameter annotation names `Config`."""
    offenders = []
    for path in sorted(Path(tetrad.plan.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                if arg is None or arg.annotation is None:
                    continue
                names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
                text = ast.unparse(arg.annotation)
                if "Config" in names or "Config" in text.replace("ModelConfig", "").split("'"):
                    offenders.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert not offenders, f"take a Config: {offenders}"


def test_no_plan_source_imports_or_builds_a_config():
    """Nor does the planner make one to validate a layout: `plan.candidates` builds its
    Layouts from the model, training and parallel sections (`Layout.of`). The one whole
    Config in `plan/` is a run directory's `config.json`, read at the edge
    (`calibrate.read_run`)."""
    offenders = []
    for path in sorted(Path(tetrad.plan.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [
                    f"{path.name}: imports {a.name}" for a in node.names if a.name == "Config"
                ]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in {
                "Config",
                "Layout.build",
            }:
                offenders.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}(...)")
    edge = [o for o in offenders if o.startswith("calibrate.py:") and "Layout.build" in o]
    assert len(edge) == 1 and offenders == edge, offenders
