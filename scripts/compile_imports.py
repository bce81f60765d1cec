"""Byte-compile what tetrad, its tests and its benchmarks import, by importing it once with
bytecode writing on (whatever PYTHONDONTWRITEBYTECODE says): every later process then loads
compiled modules. setup.sh installs with pip's --no-compile, which skips the many files of
torch and transformers that nothing here imports."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys

sys.dont_write_bytecode = False

MODULES = [
    "torch", "torch.distributed.run", "torch.distributed.pipelining",
    "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.nn.parallel",
    "torch.distributed.nn.functional", "torch.profiler", "torch.testing",
    "torch.utils.tensorboard", "safetensors.torch", "numpy", "rich", "tokenizers",
    "matplotlib.pyplot", "pytest", "pytest_timeout",
]  # fmt: skip
HF = ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]


def main() -> None:
    for name in MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import tetrad

    for info in pkgutil.walk_packages(tetrad.__path__, "tetrad."):
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)
    with contextlib.suppress(ImportError):
        transformers = importlib.import_module("transformers")
        for cls in HF:
            getattr(transformers, cls)
    print(f"compiled the {len(sys.modules)} modules tetrad imports")


if __name__ == "__main__":
    main()
