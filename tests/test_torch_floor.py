"""The torch floor pyproject.toml declares is real: tetrad calls only torch.distributed
names that torch 2.6 has (tests/data/torch_2_6_distributed.txt). Pure: it reads the source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "2.6"
ALLOWED = {
    line.strip()
    for line in (ROOT / "tests/data/torch_2_6_distributed.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def distributed_names(source: str) -> set[str]:
    """Names taken from torch.distributed in `source`: `dist.x`, `torch.distributed.x`,
    `from torch.distributed import x` (submodules count as `x.y`)."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # local names bound to the torch.distributed module
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
                elif a.name.startswith("torch.distributed."):
                    names.add(a.name.removeprefix("torch.distributed."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch.distributed":
                names |= {a.name for a in node.names}
            elif node.module.startswith("torch.distributed."):
                sub = node.module.removeprefix("torch.distributed.")
                names |= {f"{sub}.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_distributed(node.value, aliases):
            names.add(node.attr)
    return names


def _is_distributed(node: ast.expr, aliases: set[str]) -> bool:
    """`node` is an alias of torch.distributed, or `torch.distributed` itself."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def test_declared_floor_is_the_list():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+\.\d+)"', text).group(1) == FLOOR


def test_scanner_sees_every_spelling():
    src = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed import all_gather_single\n"
        "dist.reduce_scatter_single(a, b)\ntorch.distributed.all_reduce(x)\n"
        "from torch.distributed.fsdp import fully_shard\n"
    )
    assert distributed_names(src) == {
        "all_gather_single",
        "reduce_scatter_single",
        "all_reduce",
        "fsdp.fully_shard",
    }


def test_tetrad_uses_only_the_floor_api():
    """Every torch.distributed name the package uses exists in torch 2.6. (Benchmarks may
    need newer peers; the package users install may not.)"""
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src/tetrad").rglob("*.py")):
        for name in distributed_names(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert used, "the scan found no torch.distributed use at all"
    missing = {name: files for name, files in used.items() if name not in ALLOWED}
    assert not missing, f"not in torch {FLOOR}'s torch.distributed: {missing}"
    # the names that started this test: recent spellings of the long-standing collectives
    assert "all_gather_into_tensor" in used and "all_gather_single" not in ALLOWED
