"""The torch floor pyproject.toml declares is real.

Two halves. What can be read: every dotted `torch.…` name the package uses (any module,
`torch.distributed`, `torch.autograd.graph`, `torch.cuda`, …) is scanned from the source
and resolved in the installed torch, and must be in tests/data/torch_floor_names.txt,
which `scripts/floor_check.sh --write` records by resolving the same names in the floor
torch itself: a name used since fails here until the floor run has seen it. What only a
run shows (a call whose arguments changed meaning, as `autograd.backward` on a
`GradientEdge` after 2.6): the floor script runs the equivalence tests of every axis under
the floor torch, and here the pipeline's fallback for that call is run on this torch.

`python tests/test_torch_floor.py --write` rewrites the names file from the torch it runs
under (the floor script does so in its venv).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from functools import cache, partial
from pathlib import Path

import pytest
import torch

from harness import Jobs, assert_close_run, tiny_config, train_many

ROOT = Path(__file__).resolve().parents[1]
NAMES_FILE = ROOT / "tests/data/torch_floor_names.txt"
# names newer than the floor that the package uses only where the running torch has them:
# name -> the feature test every file using it must spell (its fallback runs otherwise)
NEWER_THAN_FLOOR = {"torch._grouped_mm": 'hasattr(torch, "_grouped_mm")'}


def declared_floor() -> str:
    """X.Y of pyproject.toml's "torch>=X.Y"."""
    return re.search(r'"torch>=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def torch_names(source: str) -> set[str]:
    """The longest dotted torch names `source` spells: through `import torch`, `import
    torch.x as y`, `from torch.x import y` (a name bound to torch.x.y), attribute chains on
    any of those. `torch.autograd.graph.get_gradient_edge(out)` gives that whole name."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and _from_torch(node):
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    names = set(bound.values())
    inner: set[int] = set()  # chains that are part of a longer one
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node, bound)
            if dotted:
                names.add(dotted)
    return names


def _from_torch(node: ast.ImportFrom) -> bool:
    mod = node.module or ""
    return node.level == 0 and (mod == "torch" or mod.startswith("torch."))


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def resolves(name: str) -> bool:
    """Whether `name` exists in the installed torch (attributes, or submodules imported)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return False
    return True


@cache
def used_names() -> dict[str, list[str]]:
    """Every torch name src/tetrad uses -> the files that use it (read once a session)."""
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src/tetrad").rglob("*.py")):
        for name in torch_names(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return used


def recorded() -> tuple[str, set[str]]:
    """(the torch version the names file was written under, its names)."""
    lines = NAMES_FILE.read_text().splitlines()
    version = re.match(r"# torch (\S+)", lines[0]).group(1)
    return version, {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def test_scanner_sees_every_spelling():
    src = (
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "from torch.distributed import all_gather_single\n"
        "dist.reduce_scatter_single(a, b)\ntorch.distributed.all_reduce(x)\n"
        "torch.autograd.graph.get_gradient_edge(y)\nnn.functional.silu(z)\n"
        "from .local import thing\n"
    )
    assert torch_names(src) == {
        "torch",
        "torch.distributed",
        "torch.nn",
        "torch.distributed.all_gather_single",
        "torch.distributed.reduce_scatter_single",
        "torch.distributed.all_reduce",
        "torch.autograd.graph.get_gradient_edge",
        "torch.nn.functional.silu",
    }


def test_names_file_was_written_by_the_declared_floor():
    version, _ = recorded()
    assert version.split("+")[0] == f"{declared_floor()}.0", (
        f"{NAMES_FILE.name} was written under torch {version}, pyproject.toml declares "
        f">={declared_floor()}: run scripts/floor_check.sh --write"
    )
    readme = (ROOT / "README.md").read_text()
    assert f"torch ≥ {declared_floor()}" in readme and "scripts/floor_check.sh" in readme


def test_every_name_used_resolves_in_this_torch():
    """Under the floor script this is the floor's check; here, the development torch's.
    A name newer than the floor may be missing: its users feature-test it (below)."""
    used = {n: f for n, f in used_names().items() if n not in NEWER_THAN_FLOOR}
    missing = {n: f for n, f in used.items() if not resolves(n)}
    assert not missing, f"not in torch {torch.__version__}: {missing}"


def test_every_name_used_was_seen_by_the_floor_run():
    version, seen = recorded()
    new = {n: f for n, f in used_names().items() if n not in seen | NEWER_THAN_FLOOR.keys()}
    assert not new, (
        f"used, but not resolved under torch {version} by the floor run: {new}; "
        "run scripts/floor_check.sh --write"
    )


def test_names_newer_than_the_floor_are_feature_tested_where_used():
    """A name the floor lacks is used only behind its feature test, in every file."""
    for name, guard in NEWER_THAN_FLOOR.items():
        for path in used_names().get(name, []):
            assert guard in (ROOT / path).read_text(), f"{path} uses {name} without {guard}"


def test_the_floors_backward_path_gives_the_same_gradients():
    """The fallback the pipeline takes on torch 2.6 (the engine, past the front end's
    shape check) and the GradientEdge path agree, from an output whose storage is freed."""
    from tetrad.parallel.pipeline.edge import backward_from, backward_takes_edges

    paths = [False, True] if backward_takes_edges() else [False]
    grads = []
    for edges in paths:
        x = torch.linspace(-1, 1, 12).reshape(3, 4).requires_grad_(True)
        out = (x * x).sin()
        out.data = torch.empty(0)  # as the runtime frees a sent stage output
        backward_from(out, torch.full((3, 4), 0.5), edges=edges)
        grads.append(x.grad)
    want = torch.cos(torch.linspace(-1, 1, 12) ** 2).reshape(3, 4) * torch.linspace(
        -1, 1, 12
    ).reshape(3, 4)
    for g in grads:
        torch.testing.assert_close(g, want)


FALLBACK = [("1f1b", 4, 1), ("zb-v", 4, 2)]  # (schedule, m, v) on pp 2: B and split B/W


def _fallback_configs():
    return [
        tiny_config(
            model={"layers": 4},
            train={"global_batch": 24},
            parallel={"pp": 2, "pp_schedule": s, "microbatches": m, "virtual_stages": v},
        )
        for s, m, v in FALLBACK
    ]


def _train_with_fallback(rank: int, world: int, cfg_dicts):
    """Train with the pipeline's backward forced onto the floor's path."""
    from tetrad.parallel.pipeline import runtime

    runtime.backward_from = partial(runtime.backward_from, edges=False)
    return train_many(rank, world, cfg_dicts)


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("fallback", 2, _train_with_fallback, [c.to_dict() for c in _fallback_configs()])


@pytest.mark.distributed
def test_pipeline_on_the_floors_backward_path_matches_single_process(reference, jobs):
    ref = reference(model={"layers": 4}, train={"global_batch": 24})
    for case, got in zip(FALLBACK, jobs["fallback"][0], strict=True):
        try:
            assert_close_run(got, ref)
        except AssertionError as e:
            raise AssertionError(f"schedule/m/v={case}: {e}") from None


def write_names_file() -> None:
    """Record the names the package uses that resolve in this torch; refuse if any does not
    (but those it only uses where a feature test finds them)."""
    used = {n: f for n, f in used_names().items() if n not in NEWER_THAN_FLOOR}
    missing = sorted(n for n in used if not resolves(n))
    if missing:
        sys.exit(f"not in torch {torch.__version__}: {missing}")
    head = [
        f"# torch {torch.__version__}: every torch name src/tetrad uses, each resolved in it",
        "# by scripts/floor_check.sh --write (tests/test_torch_floor.py reads this file)",
    ]
    NAMES_FILE.write_text("\n".join(head + sorted(used)) + "\n")
    print(f"{NAMES_FILE}: {len(used)} names, torch {torch.__version__}")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_names_file()
