"""Checkpoints: sharded safetensors files, a JSON manifest, atomic commits, any layout back.

On disk, OUT/checkpoints/step_00000010/ holds
  rank-00000.safetensors ...  each rank's own boxes of the logical tensors ("<name>",
                              "exp_avg/<name>", "exp_avg_sq/<name>"), fp32; a replica
                              (dp, an unsplit tensor on tp, a tied embedding on pp) writes none;
                              and its compressed reductions' error-feedback residuals
                              ("residual/<rank>/<name>", whole: one rank's own state)
  manifest.json               written last: every logical tensor's full shape and which box of
                              it each file holds, sha256 of each file, training state, data
                              position, RNG state

Save is a collective: every rank writes its file into a hidden temporary sibling and
fsyncs it; rank 0 gathers their entries, writes the manifest and renames the directory
into place, so a directory with a final name is always complete (no manifest: not a
checkpoint). One all-reduce tells every rank whether the commit happened; older
checkpoints beyond `keep` are deleted only after it. No rank ever holds a full tensor it
does not own. Load: every rank reads only the boxes it needs (safetensors' lazy slices),
after checking the sha256 of each file it reads from (streamed), and installs them for its
own layout, which is the resharding: any layout resumes from any other. Version 1
(consolidated: model.safetensors, optim.safetensors) is still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from tetrad.config import DTYPES, Config, from_dict
from tetrad.layout import Layout
from tetrad.models.families import spec_for
from tetrad.models.init import full_shape
from tetrad.parallel.boxes import Box, box_numel, box_shape, intersect, relative
from tetrad.parallel.state_adapter import BUFFER, snapshot
from tetrad.precision import wide
from tetrad.train.optim import lr_at

FORMAT = "tetrad-checkpoint"
VERSION = 2  # 1: consolidated (every tensor whole in model/optim.safetensors); still read
MANIFEST = "manifest.json"
_DIR = re.compile(r"step_(\d{8})")
_TMP = ".tmp-"  # prefix of a save in progress (or one a crash cut short)
RESIDUAL = "residual/"  # key prefix of a rank's error-feedback residuals (parallel/compress.py)


class CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be trusted (a missing, truncated or altered file, an
    unreadable manifest): `--resume` skips it for the next older one, with a warning."""


# --- finding checkpoints ------------------------------------------------------------------


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out) / "checkpoints"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the `step_XXXXXXXX` directories under `root`, oldest first."""
    found = root.iterdir() if root.is_dir() else []
    return sorted((int(m.group(1)), p) for p in found if (m := _DIR.fullmatch(p.name)))


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first: `step_XXXXXXXX` directories with a
    manifest. Anything else (a temporary directory a crash left) is not a checkpoint."""
    return [p for _, p in step_dirs(root) if (p / MANIFEST).is_file()]


def find_resume(root: Path, cfg: Config) -> list[Path]:
    """The checkpoints to try, newest first, when resuming ([] on a fresh start).

    A fresh run that would save into a directory already holding checkpoints is refused:
    its saves would be pruned against the old run's newer ones."""
    found = committed(root)
    if cfg.checkpoint.resume:
        return found[::-1]
    if found and cfg.checkpoint.every > 0:
        raise ValueError(
            f"{root} already holds checkpoints (newest: {found[-1].name}); pass --resume to "
            "continue from it, or choose another --out"
        )
    return []


# --- saving -------------------------------------------------------------------------------


def save(root: Path, step: int, engine, optimizer, loader, cfg: Config) -> Path:
    """Checkpoint the state after `step` steps (a collective: each rank writes its boxes)."""
    return Saver(asynchronous=False).save(root, step, engine, optimizer, loader, cfg)


class Saver:
    """Saves checkpoints, synchronously or in the background, at most one in flight.

    Either way the state is first snapshotted (copied: the next optimizer step cannot change
    it) on the calling thread. Asynchronously, a thread then serialises and writes this
    rank's file while training goes on; `finish` (a collective, on every rank at the same
    point: the trainer calls it once the step's all-reduce says every rank's writer is
    done, before the next save, and at the end) commits it: manifest last, one rename."""

    def __init__(self, asynchronous: bool, layout: Layout | None = None):
        self.asynchronous, self.layout = asynchronous, layout  # its split is recorded
        # a save being written: its path, temporary directory, state sections and writer
        self.pending: tuple[Path, Path, dict, Background] | None = None

    @property
    def writing(self) -> bool:
        """Whether this rank's writer thread is still busy."""
        return self.pending is not None and self.pending[3].is_alive()

    def save(
        self, root: Path, step: int, engine, optimizer, loader, cfg: Config, wait: bool = False
    ) -> Path:
        """Start (or, synchronous or `wait`, complete) the checkpoint of `step`."""
        self.finish(engine, cfg)  # the one before first: at most one in flight
        path = root / f"step_{step:08d}"
        if (path / MANIFEST).is_file():
            return path  # already committed: a resumed run that ends where it started
        tmp = prepare(path, engine)
        owned, info = owned_state(step, engine, optimizer, loader, cfg, self.layout)  # copies
        work = partial(write_shard, tmp, engine.mesh.rank, owned)
        self.pending = (path, tmp, info, Background(work, "tetrad-checkpoint"))
        return path if self.asynchronous and not wait else self.finish(engine, cfg)

    def finish(self, engine, cfg: Config) -> Path | None:
        """Wait for the save in flight, if any, and commit it (every rank calls)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        path, tmp, info, writer = pending
        writer.join()
        return commit(path, tmp, writer.value, writer.error, info, engine, cfg)


def owned_state(step: int, engine, optimizer, loader, cfg: Config, layout) -> tuple[list, dict]:
    """This rank's state after `step` steps: `engine.owned_slices` (copies), and its
    error-feedback residuals, each whole under "residual/<rank>/<name>" (zeros before its
    first reduction); and the state sections of its manifest (`describe`)."""
    owned, adam_step = engine.owned_slices(optimizer)
    for name, r in engine.grads.residuals().items():
        error = torch.zeros(r.size) if r.error is None else r.error
        owned.append((f"{RESIDUAL}{engine.mesh.rank}/{name}", ((0, r.size),), snapshot(error)))
    return owned, describe(step, adam_step, loader, cfg, layout)


class Background(threading.Thread):
    """`work()` on a daemon thread, started; its value, or its error (reported at the
    commit, agreed by every rank), kept for whoever joins it."""

    def __init__(self, work: Callable[[], Any], name: str):
        super().__init__(name=name, daemon=True)
        self.work, self.value, self.error = work, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.work()
        except BaseException as e:
            self.error = e


def prepare(path: Path, engine) -> Path:
    """The empty temporary directory every rank writes into (rank 0 makes it; agreed)."""
    tmp = path.parent / f"{_TMP}{path.name}"
    with agreed(engine, f"creating {tmp}", OSError):
        if engine.mesh.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # an earlier attempt that died half-way
            tmp.mkdir(parents=True)
    return tmp


def write_shard(tmp: Path, rank: int, owned: list) -> dict[str, Any]:
    """Write this rank's boxes into one file, fsynced; return its manifest entries."""
    if not owned:
        return {"file": None, "slices": {}}
    fname = f"rank-{rank:05d}.safetensors"
    data, entry = serialise(owned, {"file": fname})
    write_file(tmp / fname, data, sync=True)
    return {"file": fname} | entry


def serialise(owned: list, piece: dict) -> tuple[bytes, dict[str, Any]]:
    """Boxes (key, box, tensor) as safetensors bytes, box i of a logical tensor stored as
    "<key>#<i>"; and their entry: the bytes' sha256 and size, and the slices by logical
    tensor (`piece`'s fields first)."""
    tensors, slices = {}, {}
    for key, box, t in owned:
        pieces = slices.setdefault(key, [])
        skey = f"{key}#{len(pieces)}"
        tensors[skey] = t
        pieces.append(piece | {"key": skey, "box": [list(b) for b in box]})
    data = save_bytes(tensors, metadata={"format": "pt"})
    return data, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "slices": slices}


def commit(path: Path, tmp: Path, shard, error, info: dict, engine, cfg: Config) -> Path:
    """Every rank's file written into `tmp` (agreed), rank 0 writes the manifest and
    renames; agreed."""
    try:
        agree(engine, error, f"writing checkpoint {path}")
        shards = gather_json(engine, shard)
        with agreed(engine, f"committing checkpoint {path}"):
            if engine.mesh.rank == 0:
                manifest = build_manifest(shards, info, cfg)
                write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode(), sync=True)
                _fsync(tmp)
                os.replace(tmp, path)
                _fsync(path.parent)  # the rename itself survives a power cut
    except BaseException:
        if engine.mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if engine.mesh.rank == 0:
        prune(path.parent, cfg.checkpoint.keep)
    return path


# the dtypes a manifest may name: the masters' (float64 under fp64 verification)
SAVED_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_manifest(shards: list[dict], info: dict, cfg: Config) -> dict[str, Any]:
    """Files with their sha256, and every logical tensor's full shape and saved boxes;
    the boxes must tile each tensor exactly (a layout bug otherwise, caught before commit)."""
    files = {s["file"]: {"sha256": s["sha256"], "bytes": s["bytes"]} for s in shards if s["file"]}
    saved = str(wide(DTYPES[cfg.train.dtype])).removeprefix("torch.")  # the masters' dtype
    tensors: dict[str, dict] = {}
    for s in shards:
        for key, pieces in s["slices"].items():
            if key.startswith(RESIDUAL):  # a rank's own tensor, saved whole
                shape = [b for _, b in pieces[0]["box"]]
            else:
                shape = list(full_shape(key.rsplit("/", 1)[-1], cfg.model))
            entry = tensors.setdefault(key, {"shape": shape, "dtype": saved, "slices": []})
            entry["slices"] += pieces
    for key, entry in tensors.items():
        covered = sum(box_numel(tuple(map(tuple, p["box"]))) for p in entry["slices"])
        if covered != math.prod(entry["shape"]):
            raise RuntimeError(f"checkpoint boxes of {key} hold {covered} elements, not "
                               f"{math.prod(entry['shape'])}")  # fmt: skip
    head = {"format": FORMAT, "version": VERSION, "files": files, "tensors": tensors}
    return head | info


def placement(cfg: Config) -> dict[str, Any]:
    """Where the state was: degrees, world, ZeRO stage, schedule (the manifest's saved_from)."""
    p = cfg.parallel
    layout = ("dp", "fsdp", "tp", "pp", "cp", "ep", "zero_stage", "sp", "pp_schedule")
    layout += ("virtual_stages",)
    return {k: getattr(p, k) for k in layout} | {"world": p.world}


def run_record(cfg: Config, layout: Layout | None = None) -> dict[str, Any]:
    """`cfg` as a run records it (config.json, checkpoints): a measured split written as
    the layer counts `layout` fixed (the layout alone holds them)."""
    record = cfg.to_dict()
    if cfg.parallel.pp_split == "measured" and layout is not None and layout.split is not None:
        record["parallel"]["pp_split"] = ",".join(map(str, layout.split))
    return record


def describe(step: int, adam_step: int, loader, cfg: Config, layout: Layout | None = None) -> dict:
    """The manifest's state sections: training (`run_record`), data position, RNG,
    placement."""
    return {
        "training": {
            "step": step,
            "optimizer_step": adam_step,
            "next_lr": lr_at(step, cfg.train),  # the schedule is a function of the step
            "config": run_record(cfg, layout),
        },
        "data": loader.state_dict(),
        "rng": {
            # data and initial weights are functions of (seed, step, index / name) alone
            "seed": cfg.train.seed,
            "torch_cpu_state": torch.get_rng_state().numpy().tobytes().hex(),
        },
        "placement": {
            "kind": "sharded",  # each tensor as boxes, each box in one rank's file
            "saved_from": placement(cfg),
        },
    }


def gather_json(engine, obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank (two all-gathers)."""
    world = engine.mesh["world"]
    data = json.dumps(obj).encode()
    sizes = torch.zeros(world.size, dtype=torch.int64, device=engine.device)
    engine.comm.all_gather(sizes, torch.tensor([len(data)], device=engine.device), world)
    width = int(sizes.max())
    mine = torch.frombuffer(bytearray(data.ljust(width, b"\0")), dtype=torch.uint8)
    out = torch.empty(world.size * width, dtype=torch.uint8, device=engine.device)
    engine.comm.all_gather(out, mine.to(engine.device), world)
    rows = out.cpu().view(world.size, width)
    return [json.loads(bytes(rows[r, : int(n)].tolist())) for r, n in enumerate(sizes.tolist())]


def prune(root: Path, keep: int) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and leftover temporaries."""
    for old in committed(root)[:-keep]:
        (old / MANIFEST).unlink()  # first: a deletion cut short leaves a non-checkpoint
        shutil.rmtree(old)
    for tmp in root.glob(f"{_TMP}step_*"):
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def agreed(engine, what: str, errors: type[Exception] = Exception) -> Iterator[None]:
    """Run the block on every rank, then `agree` on its `errors`: a rank that failed must
    not leave the others waiting."""
    error = None
    try:
        yield
    except errors as e:
        error = e
    agree(engine, error, what)


def agree(engine, error: BaseException | None, what: str) -> None:
    """One collective: every rank learns whether any rank failed, and all fail alike.

    A `CorruptCheckpoint` on some ranks (and no other error) is raised as one on every
    rank, with the message of the lowest failing rank (gathered: this path is rare), so
    that all ranks skip the same checkpoint and one of them can say why."""
    world = engine.mesh["world"]
    if tally(error, CorruptCheckpoint, engine.comm, world, engine.device, what):
        reasons = gather_json(engine, str(error) if error else None)
        raise CorruptCheckpoint(next(r for r in reasons if r is not None))


def tally(error: BaseException | None, soft: type, comm, group, device, what: str) -> int:
    """One all-reduce over `group`: how many ranks failed with a `soft` error (returned).
    Any other error, on any rank, is raised on every rank alike: its own where it has one,
    else a RuntimeError counting the others."""
    is_soft = isinstance(error, soft)
    flags = [float(is_soft), float(error is not None and not is_soft)]
    failed = torch.tensor(flags, dtype=torch.float64, device=device)
    comm.all_reduce(failed, group)
    n_soft, n_other = (int(x) for x in failed.tolist())
    if n_other:
        if error is not None and not is_soft:
            raise error
        raise RuntimeError(f"{what} failed on {n_other} other rank(s); see theirs")
    return n_soft


# --- loading ------------------------------------------------------------------------------


class SliceReader:
    """A checkpoint on disk: its manifest (read and its format checked on construction),
    and boxes of its logical tensors. For each box asked, only the overlapping parts of the
    saved boxes are read (safetensors' lazy slices), from files whose sha256 was checked
    (streamed, once) before their first use. Whole tensors (`model`, `buffers`, `optim`) are
    for tests, export and inspection; training reads only its own boxes."""

    def __init__(self, path: Path):
        file = path / MANIFEST
        try:
            manifest = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CorruptCheckpoint(f"checkpoint manifest {file} is unreadable: {e}") from e
        if manifest.get("format") != FORMAT or manifest.get("version") not in (1, VERSION):
            raise CorruptCheckpoint(
                f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r},"
                f" expected {FORMAT!r} version 1 or {VERSION}"
            )
        self.path, self.manifest, self.files = path, manifest, manifest["files"]
        self.tensors = tensor_entries(manifest)
        self._open: dict[str, Any] = {}

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """Every parameter, full size."""
        return {n: self.full(n) for n in self.tensors if "/" not in n}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Every model buffer (an MoE router's balancing bias), by its module path."""
        return {n[len(BUFFER) :]: self.full(n) for n in self.tensors if n.startswith(BUFFER)}

    @property
    def optim(self) -> dict[str, torch.Tensor]:
        """AdamW's "exp_avg/<name>", "exp_avg_sq/<name>" full size, and "step"."""
        kept = [n for n in self.tensors if "/" in n and not n.startswith((BUFFER, RESIDUAL))]
        out = {n: self.full(n) for n in kept}
        return out | {"step": torch.tensor(float(self.manifest["training"]["optimizer_step"]))}

    def __call__(self, key: str, box: Box) -> torch.Tensor:
        entry = self.tensors.get(key)
        if entry is None:
            raise CorruptCheckpoint(f"checkpoint {self.path} has no tensor {key!r}")
        dtype = SAVED_DTYPES.get(entry.get("dtype", "float32"))
        if dtype is None:
            raise CorruptCheckpoint(f"checkpoint {self.path}: {key} has dtype {entry['dtype']!r}")
        pieces = [(tuple(map(tuple, p["box"])), partial(self._read, p)) for p in entry["slices"]]
        missing = f"checkpoint {self.path}: the boxes of {key} miss part of {box}"
        return assemble(box, dtype, pieces, missing)

    def _read(self, piece: dict, index: tuple[slice, ...]) -> torch.Tensor:
        """Part `index` of a saved box, read lazily from its checked file."""
        try:
            return self._file(piece["file"]).get_slice(piece["key"])[index]
        except CorruptCheckpoint:
            raise
        except Exception as e:
            raise CorruptCheckpoint(f"{self.path / piece['file']}: {piece['key']}: {e}") from e

    def full(self, key: str) -> torch.Tensor:
        return self(key, tuple((0, n) for n in self.tensors[key]["shape"]))

    def shape(self, key: str) -> tuple[int, ...] | None:
        """A saved tensor's full shape (None: not saved)."""
        entry = self.tensors.get(key)
        return None if entry is None else tuple(entry["shape"])

    def _file(self, fname: str):
        if fname not in self._open:
            file = self.path / fname
            if fname not in self.files:
                raise CorruptCheckpoint(f"{file} is not listed in {MANIFEST}")
            if not file.is_file():
                raise CorruptCheckpoint(f"checkpoint file {file} is missing")
            with open(file, "rb") as fh:  # streamed: memory stays one chunk
                got = hashlib.file_digest(fh, "sha256").hexdigest()
            want = self.files[fname]["sha256"]
            if got != want:
                raise CorruptCheckpoint(
                    f"checkpoint file {file} is corrupt: sha256 {got} != {want} in {MANIFEST}"
                )
            try:
                self._open[fname] = safe_open(file, "pt")  # tensors only, no code
            except Exception as e:
                raise CorruptCheckpoint(f"{file} is not a safetensors file: {e}") from e
        return self._open[fname]


def assemble(box: Box, dtype: torch.dtype, pieces: list, missing: str) -> torch.Tensor:
    """`box` of a logical tensor from the saved boxes that overlap it; `pieces`: (saved box,
    read(index into it)). A box they do not cover whole is a CorruptCheckpoint(`missing`)."""
    out, covered = torch.empty(box_shape(box), dtype=dtype), 0
    for saved, read in pieces:
        common = intersect(saved, box)
        if common is not None:
            out[relative(common, box)] = read(relative(common, saved))
            covered += box_numel(common)
    if covered != box_numel(box):
        raise CorruptCheckpoint(missing)
    return out


def tensor_entries(manifest: dict[str, Any]) -> dict[str, dict]:
    """Logical tensor -> {shape, dtype, slices}; version 1's whole tensors as one box each."""
    if manifest["version"] >= 2:
        return manifest["tensors"]
    return {
        name: e
        | {"slices": [{"file": e["file"], "key": name, "box": [[0, n] for n in e["shape"]]}]}
        for name, e in manifest["tensors"].items()
        if name != "step"  # version 1 kept Adam's count as a tensor; it is in "training"
    }


def read(path: Path) -> SliceReader:
    """A checkpoint whose manifest parses and whose every file matches its sha256."""
    ckpt = SliceReader(path)
    for fname in ckpt.files:
        ckpt._file(fname)
    return ckpt


def check_model(path: Path, tensors: dict[str, dict], cfg: Config) -> None:
    """The checkpoint's parameters are this model's: same logical names, same full shapes."""
    names = [n for n, _ in spec_for(cfg.model).build(cfg.model).named_parameters()]
    want = {n: tuple(full_shape(n, cfg.model)) for n in names}
    got = {n: tuple(e["shape"]) for n, e in tensors.items() if "/" not in n}
    if want != got:
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        detail = ", ".join(f"{n}: checkpoint {got.get(n)} vs model {want.get(n)}" for n in bad[:4])
        raise ValueError(f"checkpoint {path} does not fit model {cfg.model}: {detail}")


def restore(path: Path, engine, optimizer, loader, cfg: Config) -> int:
    """Load `path` on every rank, each reading and installing only its own boxes; returns
    the step. A rank that cannot load fails every rank (agreed) before the ZeRO gathers."""
    with agreed(engine, f"loading checkpoint {path}"):
        reader = SliceReader(path)
        check_model(path, reader.tensors, cfg)
        install(reader, reader.manifest, engine, optimizer, loader, cfg)
    engine.after_load()
    if engine.mesh.rank == 0:
        print(f"tetrad: resumed from {path}", flush=True)
    return int(reader.manifest["training"]["step"])


def install(reader, state: dict, engine, optimizer, loader, cfg: Config) -> None:
    """This rank's boxes through `reader`, its residuals, and a saved `state`'s Adam step
    count, data position and RNG state."""
    engine.load_owned(reader, int(state["training"]["optimizer_step"]), optimizer)
    load_residuals(reader, state, engine, cfg)
    loader.load_state_dict(state["data"])
    rng = bytes.fromhex(state["rng"]["torch_cpu_state"])
    torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))


def load_residuals(reader, state: dict, engine, cfg: Config) -> None:
    """This rank's error-feedback residuals from their saved values, when the checkpoint was
    saved by this placement (`placement`: the same world, degrees, stage and schedule) and
    holds each of them at its size; else every one starts from zero, as on a fresh start,
    and rank 0 says so: on another world or layout (an elastic shrink) rank r's residuals
    were dropped from another rank's gradient, or from other pieces of it."""
    held = engine.grads.residuals()
    if not held:
        return
    keys = {n: f"{RESIDUAL}{engine.mesh.rank}/{n}" for n in held}
    saved, now = state.get("placement", {}).get("saved_from"), placement(cfg)
    fits = saved == now and all(reader.shape(keys[n]) == (r.size,) for n, r in held.items())
    for n, r in held.items():
        r.error = reader(keys[n], ((0, r.size),)).to(engine.device) if fits else None
    if engine.mesh.rank == 0 and not fits:
        why = f"saved at {saved}, resumed at {now}" if saved != now else "not in the checkpoint"
        print(f"tetrad: the compressed reductions' residuals start from zero ({why})", flush=True)


def restore_newest(root: Path, engine, optimizer, loader, cfg: Config) -> int | None:
    """Resume from the newest *valid* checkpoint under `root` (every rank calls).

    A corrupt or incomplete newer one is skipped with one warning (rank 0) naming the file
    and the reason; every rank skips the same ones (`agree`). Returns the step, or None
    when not resuming or there is no checkpoint; all of them corrupt is an error."""
    candidates = find_resume(root, cfg)
    warn = print if engine.mesh.rank == 0 else (lambda *_, **__: None)
    newest = int(candidates[0].name[5:]) if candidates else -1
    for step, cut in step_dirs(root):  # newer saves without a manifest: cut short
        if cfg.checkpoint.resume and step > newest and not (cut / MANIFEST).is_file():
            warn(f"tetrad: warning: skipping {cut}: no {MANIFEST} (a save cut short)", flush=True)
    reasons = []
    for path in candidates:
        try:
            return restore(path, engine, optimizer, loader, cfg)
        except CorruptCheckpoint as e:
            warn(f"tetrad: warning: skipping checkpoint {path.name}: {e}", flush=True)
            reasons.append(str(e))
    if candidates:
        raise ValueError(f"no valid checkpoint under {root}: {'; '.join(reasons)}")
    return None


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


def load_model(path: str | Path, buffers: bool = False) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run's configuration and every logical parameter, full size, of a checkpoint (or
    of a run's newest one), verified; with `buffers`, the model's buffers too (a
    `load_state_dict` of the whole model)."""
    ckpt = read(resolve(path))
    cfg = from_dict(ckpt.manifest["training"]["config"])
    check_model(ckpt.path, ckpt.tensors, cfg)
    return cfg, ckpt.model | (ckpt.buffers if buffers else {})


# --- files --------------------------------------------------------------------------------


def write_file(path: Path, data: Any, sync: bool = False) -> None:
    """Write `data` (any bytes-like object); with `sync`, fsynced (a durable file: memory-
    backed ones need none). A full medium shows here, as ENOSPC."""
    with open(path, "wb") as fh:
        fh.write(memoryview(data))
        if sync:
            fh.flush()
            os.fsync(fh.fileno())


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
