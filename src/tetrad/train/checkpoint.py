"""Checkpoints: consolidated logical tensors in safetensors files, a JSON manifest, atomic commits.

On disk, OUT/checkpoints/step_00000010/ holds
  model.safetensors   every parameter by logical name, full size, float32
  optim.safetensors   AdamW state: "exp_avg/<name>", "exp_avg_sq/<name>" (full size), "step"
  manifest.json       written last: format, every tensor (file, shape, dtype), placement,
                      sha256 of each file, training state, data position, RNG state

Save is a collective: every rank helps its engine gather the full tensors, rank 0 writes
them into a hidden temporary sibling, fsyncs, and renames it into place, so a directory
with a final name is always complete (no manifest: not a checkpoint). One all-reduce then
tells every rank whether the commit happened; older checkpoints beyond `keep` are deleted
only after it. Load: every rank verifies each file's sha256 on the very bytes it then
parses (safetensors, never pickle) and installs exactly its slice for its own layout,
which is the resharding: any layout resumes from any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from tetrad.config import Config, from_dict
from tetrad.models.init import full_shape
from tetrad.models.llama import meta_llama
from tetrad.train.optim import lr_at

FORMAT = "tetrad-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
FILES = {"model": "model.safetensors", "optim": "optim.safetensors"}
_DIR = re.compile(r"step_(\d{8})")
_TMP = ".tmp-"  # prefix of a save in progress (or one a crash cut short)


@dataclass
class Checkpoint:
    """A verified checkpoint read into memory: its manifest and full tensors by file."""

    path: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.manifest["training"]["step"])


# --- finding checkpoints ------------------------------------------------------------------


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out) / "checkpoints"


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first: `step_XXXXXXXX` directories with a
    manifest. Anything else (a temporary directory a crash left) is not a checkpoint."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        match = _DIR.fullmatch(p.name)
        if match and (p / MANIFEST).is_file():
            found.append((int(match.group(1)), p))
    return [p for _, p in sorted(found)]


def find_resume(root: Path, cfg: Config) -> Path | None:
    """The checkpoint to start from: the newest one when resuming (None if there is none).

    A fresh run that would save into a directory already holding checkpoints is refused:
    its saves would be pruned against the old run's newer ones."""
    found = committed(root)
    if cfg.checkpoint.resume:
        return found[-1] if found else None
    if found and cfg.checkpoint.every > 0:
        raise ValueError(
            f"{root} already holds checkpoints (newest: {found[-1].name}); pass --resume to "
            "continue from it, or choose another --out"
        )
    return None


# --- saving -------------------------------------------------------------------------------


def save(root: Path, step: int, engine, optimizer, loader, cfg: Config) -> Path:
    """Checkpoint the state after `step` steps (every rank calls; rank 0 writes)."""
    model = engine.full_state_dict()
    optim = engine.full_optimizer_state(optimizer)
    path, error = root / f"step_{step:08d}", None
    if engine.mesh.rank == 0 and not (path / MANIFEST).is_file():
        # (already committed: a resumed run that ends where it started)
        try:
            info = describe(step, optim, loader, cfg)
            write(path, {"model": model, "optim": optim}, info)
        except Exception as e:  # any failure must be agreed on, or the ranks diverge
            error = e
    agree(engine, error, f"saving checkpoint {path}")
    if engine.mesh.rank == 0:
        prune(root, cfg.checkpoint.keep)
    return path


def describe(step: int, optim: dict[str, torch.Tensor], loader, cfg: Config) -> dict:
    """The manifest's state sections: training, data position, RNG, placement."""
    p = cfg.parallel
    layout = ("dp", "fsdp", "tp", "pp", "zero_stage", "sp", "pp_schedule", "virtual_stages")
    return {
        "training": {
            "step": step,
            "optimizer_step": int(optim["step"]),
            "next_lr": lr_at(step, cfg.train),  # the schedule is a function of the step
            "config": cfg.to_dict(),
        },
        "data": loader.state_dict(),
        "rng": {
            # data and initial weights are functions of (seed, step, index / name) alone
            "seed": cfg.train.seed,
            "torch_cpu_state": torch.get_rng_state().numpy().tobytes().hex(),
        },
        "placement": {
            "kind": "consolidated",  # every tensor whole; the loader cuts its own slice
            "saved_from": {k: getattr(p, k) for k in layout} | {"world": p.world_size},
        },
    }


def write(path: Path, tensors: dict[str, dict[str, torch.Tensor]], info: dict) -> None:
    """Write a checkpoint directory atomically: files, then the manifest, then one rename."""
    tmp = path.parent / f"{_TMP}{path.name}"
    if tmp.exists():
        shutil.rmtree(tmp)  # an earlier attempt that died half-way
    tmp.mkdir(parents=True)
    try:
        entries, digests = {}, {}
        for key, fname in FILES.items():
            data = save_bytes(tensors[key], metadata={"format": "pt"})
            _write_synced(tmp / fname, data)
            digests[fname] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            for name, t in tensors[key].items():
                entries[name] = {"file": fname, "shape": list(t.shape), "dtype": _dtype(t)}
        manifest = {"format": FORMAT, "version": VERSION, "files": digests, "tensors": entries}
        _write_synced(tmp / MANIFEST, json.dumps(manifest | info, indent=1).encode())
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)  # the rename itself survives a power cut
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune(root: Path, keep: int) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and leftover temporaries."""
    for old in committed(root)[:-keep]:
        (old / MANIFEST).unlink()  # first: a deletion cut short leaves a non-checkpoint
        shutil.rmtree(old)
    for tmp in root.glob(f"{_TMP}step_*"):
        shutil.rmtree(tmp, ignore_errors=True)


def agree(engine, error: BaseException | None, what: str) -> None:
    """One collective: every rank learns whether any rank failed, and all fail alike."""
    failed = torch.tensor(
        [0.0 if error is None else 1.0], dtype=torch.float64, device=engine.device
    )
    engine.comm.all_reduce(failed, engine.mesh["world"])
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"{what} failed on {int(failed.item())} other rank(s); see theirs")


# --- loading ------------------------------------------------------------------------------


def read(path: Path) -> Checkpoint:
    """Read and verify a checkpoint: every file's sha256 before its tensors are parsed."""
    manifest = read_manifest(path)
    loaded = {}
    for key, fname in FILES.items():
        file = path / fname
        if not file.is_file():
            raise ValueError(f"checkpoint file {file} is missing")
        data = file.read_bytes()
        want = manifest["files"][fname]["sha256"]
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise ValueError(
                f"checkpoint file {file} is corrupt: sha256 {got} != {want} in {MANIFEST}"
            )
        loaded[key] = load_bytes(data)  # safetensors: tensors only, no code
    _check_listed(path, manifest, loaded)
    return Checkpoint(path, manifest, loaded["model"], loaded["optim"])


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint manifest {file} is unreadable: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r},"
            f" expected {FORMAT!r} version {VERSION}"
        )
    return manifest


def _check_listed(path: Path, manifest: dict, loaded: dict[str, dict[str, torch.Tensor]]) -> None:
    """The files hold exactly the tensors the manifest lists, with its shapes."""
    held = {(FILES[k], n): tuple(t.shape) for k, ts in loaded.items() for n, t in ts.items()}
    listed = {(e["file"], n): tuple(e["shape"]) for n, e in manifest["tensors"].items()}
    if held != listed:
        diff = sorted(set(held.items()) ^ set(listed.items()))[:5]
        raise ValueError(f"{path}: files and {MANIFEST} disagree on tensors, e.g. {diff}")


def check_model(ckpt: Checkpoint, cfg: Config) -> None:
    """The checkpoint's parameters are this model's: same logical names, same full shapes."""
    names = [n for n, _ in meta_llama(cfg.model).named_parameters()]
    want = {n: tuple(full_shape(n, cfg.model)) for n in names}
    got = {n: tuple(t.shape) for n, t in ckpt.model.items()}
    if want != got:
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        detail = ", ".join(f"{n}: checkpoint {got.get(n)} vs model {want.get(n)}" for n in bad[:4])
        raise ValueError(f"checkpoint {ckpt.path} does not fit model {cfg.model}: {detail}")


def restore(path: Path, engine, optimizer, loader, cfg: Config) -> int:
    """Load `path` on every rank, each installing its own slices; returns the step."""
    ckpt, error = None, None
    try:
        ckpt = read(path)
        check_model(ckpt, cfg)
        engine.load_full(ckpt.model, ckpt.optim, optimizer)
        loader.load_state_dict(ckpt.manifest["data"])
        state = bytes.fromhex(ckpt.manifest["rng"]["torch_cpu_state"])
        torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except Exception as e:  # a rank that cannot load must not leave the others waiting
        error = e
    agree(engine, error, f"loading checkpoint {path}")
    return ckpt.step


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory's newest committed checkpoint."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    found = committed(p / "checkpoints")
    if found:
        return found[-1]
    raise ValueError(
        f"{p} is neither a checkpoint (no {MANIFEST}) nor a run with committed checkpoints "
        f"under {p / 'checkpoints'} (train with --checkpoint-every K)"
    )


def load_model(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run's configuration and every logical parameter, full size, of a checkpoint (or
    of a run's newest one), verified."""
    ckpt = read(resolve(path))
    cfg = from_dict(ckpt.manifest["training"]["config"])
    check_model(ckpt, cfg)
    return cfg, ckpt.model


# --- files --------------------------------------------------------------------------------


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
