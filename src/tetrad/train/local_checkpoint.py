"""In-memory checkpoints with a partner copy: a failure costs at most K steps, not a save interval.

Every K steps (`--local-checkpoint-every K`) each rank snapshots the boxes it owns (the
sharded checkpoint's: model, AdamW moments, and in the JSON the step, data position and
RNG) on the training thread, and a background thread then

  1. serialises them and writes LOCAL/step_S/rank-R.safetensors, then rank-R.json (last,
     by rename: the sha256 of the tensor file, the boxes, the training state);
  2. swaps them with its partners (counted): sends its own to `partner_of(R)`, the rank
     `local_world_size` ahead (on another node, so that losing a node loses no rank's only
     copy; on one node, the next rank), and receives, and writes as copy-Q.*, the state of
     the rank Q whose partner it is.

The swap is host to host: the bytes go from host memory over a gloo group made for it,
never through the compute device or an NCCL communicator (`STAGING`). On the order of the
exchanges: that group carries nothing but this module's calls, and they are issued in the
same order on every rank: a generation's two swaps (the size, then the JSON and tensor
bytes as one blob) by its thread, then, on the training thread after joining that thread,
the commit's all-reduce, then the next generation's swaps (at most one generation in
flight); a restore runs before the first. So no rank can pair a swap with another rank's
commit, and the training thread's NCCL collectives share no communicator with the thread
(NCCL documents that concurrent communicators on one device can deadlock; a gloo group
holds none).

LOCAL is node-local memory (/dev/shm by default). At most one generation is in flight:
when the next is due, every rank first waits for its writer (counted when it had to
wait) and one small all-reduce agrees whether every rank wrote both copies; only then is
that generation committed, and older ones deleted. So a node holds at most two: the
committed one and the one being written.

Restart (the workers `--max-restarts` restarted, or any run with `checkpoint.resume` that
finds the directory; the launcher frees it when the job ends): every rank checks the files
of its node that its local rank wrote (its own and the partner copies it holds; sha256
against their JSON: a bad copy is skipped with a warning); one all-gather of which ranks'
states each holds lets every rank pick the same newest generation that every rank's state
is complete in, wherever it is held. Each state is then broadcast, host to host over the
partner group, from one rank that holds it (every rank reads the boxes it needs, as from a
durable checkpoint, so replicas are filled too), and only the boxes loaded reach the
device. The ranks of the generation are those of the world that wrote it, not necessarily
this one's: after an elastic shrink (`--dp auto`, a node lost) the survivors hold every
rank's state between their own files and the copies of the lost node's ranks, and the
boxes, pieces of whole logical tensors, are read into the new layout's shards as the
durable checkpoint's resume at another layout reads them. A generation is its step and the
world that wrote it: a directory written again after a shrink may still hold the old
world's files, and a state of one world never completes the other's. A generation older
than the newest durable checkpoint, or none complete, falls back to the durable
checkpoint, with a line saying why. A failed write (a full /dev/shm) turns in-memory
checkpoints off for the rest of the run with one warning; durable checkpoints go on.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_bytes

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.layout import Layout, fixed_layout
from tetrad.mesh import Group
from tetrad.parallel.boxes import Box
from tetrad.train.checkpoint import (
    Background,
    CorruptCheckpoint,
    agreed,
    assemble,
    gather_json,
    install,
    owned_state,
    run_record,
    serialise,
    step_dirs,
    tally,
    write_file,
)

FORMAT = "tetrad-local-checkpoint"
_HEADER = struct.Struct("<Q")  # a blob a restore moves: JSON length, JSON, tensor bytes
# where a partner copy is staged, sent, received and gathered: host memory, never the
# compute device (the exchanges run on a gloo group; see the module docstring)
STAGING = torch.device("cpu")


def local_root(cfg: Config) -> Path:
    """The node-local directory of this run's in-memory checkpoints: `checkpoint.local_dir`,
    or /dev/shm/tetrad-<hash of the run's --out> (the temporary directory where there is
    no /dev/shm), the same on every node and across restarts of the run."""
    if cfg.checkpoint.local_dir:
        return Path(cfg.checkpoint.local_dir)
    run = hashlib.sha256(os.path.abspath(cfg.train.out).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tetrad-{run}"


def partner_shift(world: int, local_world: int) -> int:
    """How far ahead a rank's partner is: a node's worth of ranks (the same local rank on
    the next node), or, on one node, the next rank."""
    return local_world if world > local_world else 1


def partner_of(rank: int, world: int, local_world: int) -> int:
    """The rank that holds `rank`'s copy."""
    return (rank + partner_shift(world, local_world)) % world


def held_from(rank: int, world: int, local_world: int) -> int:
    """The rank whose copy `rank` holds."""
    return (rank - partner_shift(world, local_world)) % world


def newest_complete(held: list[list[dict]]) -> tuple[int | None, list[int]]:
    """The newest generation every rank's state is in, and for each rank q of the world
    that wrote it the rank of this world that provides q's state (q itself if it holds it,
    else the lowest that does); (None, []) if none.

    held[r] lists the generations rank r holds states of, each {"step", "world": the size
    of the world that wrote it, "ranks": the ranks whose state r holds, verified}. A
    generation is its step and its world: one step written by two worlds (a directory
    reused after a shrink) is two generations, neither completed by the other's states
    (both complete: the larger world's, either would do). Pure: every rank computes it
    from the same gather."""
    for step, world in _generations_held(held):
        providers = _providers(held, step, world)
        if None not in providers:
            return step, providers
    return None, []


def why_not(held: list[list[dict]], step: int | None, newer_than: int) -> str | None:
    """Why a restore takes no in-memory generation (`newest_complete` gave `step`, too old
    if not newer than `newer_than`); None when no rank holds any."""
    if step is not None:
        return (
            f"the newest complete in-memory checkpoint, of step {step}, is older than the "
            f"durable checkpoint of step {newer_than + 1}"
        )
    gaps = []
    for s, world in _generations_held(held):
        lost = [q for q, p in enumerate(_providers(held, s, world)) if p is None]
        gaps.append(f"step {s} of {world} ranks lacks rank(s) {', '.join(map(str, lost))}")
    return f"no in-memory checkpoint is complete ({'; '.join(gaps)})" if gaps else None


def _generations_held(held: list[list[dict]]) -> list[tuple[int, int]]:
    """(step, world) of every generation some rank holds a state of, newest first."""
    return sorted({(g["step"], g["world"]) for h in held for g in h if g["ranks"]}, reverse=True)


def _providers(held: list[list[dict]], step: int, world: int) -> list[int | None]:
    """Who provides each rank q's state of generation (step, world): q itself if it holds
    it, else the lowest rank that does; None: no rank does."""
    mine = [[g["ranks"] for g in h if (g["step"], g["world"]) == (step, world)] for h in held]
    holders = [set().union(*rows) for rows in mine]
    have = [[r for r, ranks in enumerate(holders) if q in ranks] for q in range(world)]
    return [(q if q in h else h[0]) if h else None for q, h in enumerate(have)]


class LocalCheckpoints:
    """This rank's in-memory checkpoints: start a generation, commit it, restore from one.

    Built by every rank (with `checkpoint.local_every` > 0) before its first step, on the
    training thread: the partner group it makes is a collective. `comm` lends only its
    watchdog: nothing here is staged on its compute device. `layout`: the run's, whose
    split (a measured one) the states record."""

    def __init__(self, cfg: Config, engine, comm: Comm, layout: Layout | None = None):
        self.cfg, self.engine, self.layout = cfg, engine, layout
        self.every = cfg.checkpoint.local_every
        self.root = local_root(cfg)
        self.rank, self.world = engine.mesh.rank, engine.mesh.world
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.local_world))
        self.partner = partner_of(self.rank, self.world, self.local_world)
        self.source = held_from(self.rank, self.world, self.local_world)
        # the partner copies move on one gloo group, from host memory: the swaps on a thread
        # of their own, through their own `Comm` (no watchdog: its one armed slot is the
        # training thread's; the group's timeout bounds a wait), the commit's all-reduce
        # and a restore's broadcasts on the training thread, watched
        self.group = _partner_group(self.rank, self.world, cfg.train.timeout + 60)
        self.swap_comm = Comm(STAGING)
        self.host_comm = Comm(STAGING, comm.watchdog)
        self.enabled = True
        self.pending: tuple[int, Background] | None = None  # a generation being written
        self.restored_world: int | None = None  # the world of the generation restored
        self.waits = 0
        self.stalled_s = 0.0  # the training thread's time in snapshots, waits and commits
        self.warnings: list[str] = []  # what this rank printed (tests read them)
        if not cfg.checkpoint.resume and self.local_rank == 0:
            clear(self.root)  # a fresh run: an earlier run's generations are not ours
        if self.rank == 0:
            print(f"tetrad: in-memory checkpoints every {self.every} steps in {self.root}, "
                  f"{_where_copies(self.world, self.local_world)}", flush=True)  # fmt: skip

    # --- writing ------------------------------------------------------------------------

    def after_step(self, step: int, optimizer, loader) -> dict[str, Any]:
        """At a due step (every rank alike): commit the generation in flight, then start
        the one of `step`. Returns the metrics fields of a commit ({} otherwise)."""
        if not self.enabled or step % self.every:
            return {}
        t0 = time.perf_counter()
        row = self.finish()
        if self.enabled:
            self.start(step, optimizer, loader)
        self.stalled_s += time.perf_counter() - t0
        return row

    def start(self, step: int, optimizer, loader) -> None:
        """Snapshot this rank's boxes (copies) and write them in the background."""
        owned, info = owned_state(step, self.engine, optimizer, loader, self.cfg, self.layout)
        info |= {"local_world": self.local_world}
        work = partial(self._write, step, owned, info)
        self.pending = (step, Background(work, "tetrad-local-checkpoint"))

    def _write(self, step: int, owned: list, info: dict) -> None:
        """The background half: own files, the swap with the partners, the copy held (host
        memory only: this thread touches no device)."""
        directory = self.root / f"step_{step:08d}"
        # it may hold an older world's files of this step (a shrunk world that reached it
        # again): harmless, since a file counts only towards the world its JSON names
        directory.mkdir(parents=True, exist_ok=True)
        meta, data = pack(self.rank, owned, info)
        store(directory, f"rank-{self.rank:05d}", meta, data)
        if self.world > 1:
            meta, data = self._swap(meta, data)
        store(directory, f"copy-{self.source:05d}", meta, data)

    def _swap(self, meta: dict, data: bytes) -> tuple[dict, Any]:
        """Send this rank's state, as one blob (`join`), to the partner and receive the
        source's (its size first; what is received is written as it came, without another
        copy). Host buffers, pageable: over gloo nothing crosses to a device, so pinning
        would only lock RAM (and cost a slow allocation per generation)."""
        blob = join(meta, data)
        size = torch.tensor([len(blob)], dtype=torch.int64, device=STAGING)
        theirs = torch.zeros(1, dtype=torch.int64, device=STAGING)
        self._exchange(size, theirs)
        recv = torch.empty(int(theirs), dtype=torch.uint8, device=STAGING)
        self._exchange(torch.frombuffer(blob, dtype=torch.uint8), recv)
        return unpack(memoryview(recv.numpy()))

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [("send", send, self.partner), ("recv", recv, self.source)]
        for work in self.swap_comm.batch_p2p(ops, self.group):
            work.wait()

    def finish(self) -> dict[str, Any]:
        """Wait for the generation in flight and commit it if every rank wrote both of its
        copies (one all-reduce; every rank calls); a failure anywhere turns in-memory
        checkpoints off, with one warning. Returns its metrics fields."""
        pending, self.pending = self.pending, None
        if pending is None:
            return {}
        (step, writer), waited = pending, 0.0
        if writer.is_alive():
            t0 = time.perf_counter()
            writer.join()
            waited = time.perf_counter() - t0
            self.waits += 1
        # the writers joined: the group is idle. An error other than the medium's (an
        # OSError) is a bug, raised alike on every rank
        what = "an in-memory checkpoint"
        n_os = tally(writer.error, OSError, self.host_comm, self.group, STAGING, what)
        if n_os:
            self._give_up(step, writer.error, n_os)
            return {"local_checkpoint_failed": step}
        prune(self.root, step)
        return {
            "local_checkpoint": step,
            "local_checkpoint_waited_s": waited,
            "local_checkpoint_waits": self.waits,  # so far: due steps that found it busy
            "local_checkpoint_sent_bytes": self.swap_comm.total_bus_bytes(),
        }

    def _give_up(self, step: int, error: OSError | None, ranks: int) -> None:
        """Off for the rest of the run, this generation's files removed; one warning (rank
        0), naming the first failing rank's reason (gathered: this path is rare)."""
        self.enabled = False
        discard(self.root, self.rank, self.source, step)
        reasons = gather_json(self.engine, _describe_error(error) if error else None)
        first = next((r, why) for r, why in enumerate(reasons) if why)
        durable = "durable checkpoints go on" if self.cfg.checkpoint.every else (
            "and no durable checkpoints are set (--checkpoint-every)"
        )  # fmt: skip
        self.warn(
            f"tetrad: warning: the in-memory checkpoint of step {step} failed on {ranks} "
            f"rank(s) (rank {first[0]}: {first[1]}); in-memory checkpoints are off for the "
            f"rest of the run, {durable}",
            agreed=True,
        )

    def warn(self, message: str, agreed: bool = False) -> None:
        """A warning of this rank's own (a file it holds), or one every rank `agreed` on:
        printed once, by rank 0."""
        self.warnings.append(message)
        if not agreed or self.rank == 0:
            print(message, flush=True)

    def close(self, finished: bool) -> None:
        """Wait for (and commit) the generation in flight; a finished run's files are
        removed (they are memory, and no restart needs them)."""
        t0 = time.perf_counter()
        self.finish()
        self.stalled_s += time.perf_counter() - t0
        if finished:
            discard(self.root, self.rank, self.source)

    # --- restoring ----------------------------------------------------------------------

    def restore(self, optimizer, loader, newer_than: int = -1) -> int | None:
        """Load the newest generation that every rank's state is complete in, if newer than
        `newer_than` (every rank calls; the choice is agreed). Returns its step, or None,
        then saying why (rank 0) if any rank held a generation."""
        args = (self.local_rank, self.local_world, self.cfg, self.warn, self.layout)
        mine, blobs = scan(self.root, *args)
        held = gather_json(self.engine, mine)
        step, providers = newest_complete(held)
        if step is None or step <= newer_than:
            reason = why_not(held, step, newer_than)
            if reason is not None:  # a warning when memory held something unusable
                level = "warning: " if step is None else ""
                self.warn(f"tetrad: {level}not resuming from memory: {reason}", agreed=True)
            return None
        self.restored_world = world = len(providers)
        states = self._gather_states([blobs.get((step, world, q)) for q in range(world)], providers)
        with agreed(self.engine, f"loading the in-memory checkpoint of step {step}"):
            self._load(states, optimizer, loader)
        self.engine.after_load()
        return step

    def _gather_states(self, mine: list[bytes | None], providers: list[int]) -> list[bytes]:
        """Every saved rank's blob on every rank: rank q's broadcast from `providers[q]`
        (q itself, or a rank holding its copy), which holds it in mine[q]. Host to host
        over the partner group: nothing of it is staged on the device."""
        out = []
        for q, provider in enumerate(providers):
            blob = mine[q] if provider == self.rank else b""
            size = torch.tensor([len(blob)], dtype=torch.int64, device=STAGING)
            self.host_comm.broadcast(size, provider, self.group)
            buf = bytearray(blob or int(size))  # the provider's blob, or room for it
            self.host_comm.broadcast(torch.frombuffer(buf, dtype=torch.uint8), provider, self.group)
            out.append(bytes(buf))
        return out

    def _load(self, blobs: list[bytes], optimizer, loader) -> None:
        """Install this rank's boxes from every rank's blob, and its own training state."""
        metas, tensors = zip(*(unpack(b) for b in blobs))
        for meta, data in zip(metas, tensors):
            check_sha(meta, data)
        reader = BlobReader(list(metas), [load_bytes(d) for d in tensors])
        # the training state is every rank's alike; the RNG state is per rank: a rank of a
        # smaller world takes the one of the rank it is numbered as (any would do: data and
        # weights depend on the seed and the step alone)
        install(reader, metas[self.rank % len(metas)], self.engine, optimizer, loader, self.cfg)


# --- blobs and files ------------------------------------------------------------------------


def pack(rank: int, owned: list, info: dict) -> tuple[dict, bytes]:
    """One rank's state: its JSON (boxes, sha256 of the tensor bytes, training state) and
    its safetensors bytes."""
    data, entry = serialise(owned, {})
    return {"format": FORMAT, "rank": rank} | entry | info, data


def join(meta: dict, data: Any) -> bytearray:
    """JSON and tensor bytes as one blob (what a swap sends and a restore broadcasts)."""
    head = json.dumps(meta).encode()
    return bytearray().join((_HEADER.pack(len(head)), head, data))


def unpack(blob: Any) -> tuple[dict, Any]:
    """(JSON, tensor bytes) of a blob (any bytes-like object: the tensor bytes a slice of
    it, a view of a memoryview); a malformed one is a CorruptCheckpoint."""
    try:
        (n,) = _HEADER.unpack_from(blob)
        return json.loads(bytes(blob[_HEADER.size : _HEADER.size + n])), blob[_HEADER.size + n :]
    except (struct.error, ValueError) as e:
        raise CorruptCheckpoint(f"unreadable: {e}") from e


def store(directory: Path, stem: str, meta: dict, data: Any) -> None:
    """STEM.safetensors, then STEM.json by rename (a JSON means both are whole). `data`:
    any bytes-like object. Memory-backed: no fsync; a full /dev/shm shows as ENOSPC."""
    write_file(directory / f"{stem}.safetensors", data)
    tmp = directory / f".{stem}.json"
    write_file(tmp, json.dumps(meta).encode())
    os.replace(tmp, directory / f"{stem}.json")


def check_sha(meta: dict, data: bytes) -> None:
    got = hashlib.sha256(data).hexdigest()
    if got != meta.get("sha256"):
        raise CorruptCheckpoint(f"sha256 {got} != {meta.get('sha256')} in its JSON")


def check_meta(meta: dict, step: int, rank: int, cfg: Config, layout: Layout | None = None) -> None:
    """The blob is rank `rank`'s state after `step` steps of this run's model and layout
    (`run_record`: with `layout`'s split)."""
    if meta.get("format") != FORMAT or meta.get("rank") != rank:
        raise CorruptCheckpoint(f"not rank {rank}'s {FORMAT} (format {meta.get('format')!r})")
    if meta["training"]["step"] != step:
        raise CorruptCheckpoint(f"holds step {meta['training']['step']}, not {step}")
    saved = meta["training"]["config"]
    now = run_record(cfg, layout)
    if saved["model"] != now["model"] or (
        fixed_layout(saved["parallel"]) != fixed_layout(now["parallel"])
    ):
        raise CorruptCheckpoint("written by another model or layout")


def scan(
    root: Path, local_rank: int, local_world: int, cfg: Config, warn, layout: Layout | None = None
) -> tuple[list[dict], dict[tuple[int, int, int], bytes]]:
    """Which ranks' states of which generations a rank holds (the files under `root` that
    its local rank wrote, each verified: format, this run's model and fixed layout, world,
    sha256), as `newest_complete`'s rows; and those blobs by (step, world, rank). A
    generation is a step and a world: a directory may hold files of two worlds (written
    again after a shrink), each file counted in its own. `warn(message)`: a bad file."""
    held: list[dict] = []
    blobs: dict[tuple[int, int, int], bytes] = {}
    for step, directory in reversed(step_dirs(root)):
        worlds: dict[int, list[int]] = {}
        for stem, rank, world, meta in _written_here(directory, local_rank, local_world):
            if (step, world, rank) in blobs:  # its own file and a copy: the same state
                continue
            blob = _verified(stem, meta, step, rank, cfg, warn, layout)
            if blob is not None:
                blobs[(step, world, rank)] = blob
                worlds.setdefault(world, []).append(rank)
        held += [{"step": step, "world": w, "ranks": sorted(r)} for w, r in sorted(worlds.items())]
    return held, blobs


def _written_here(directory: Path, local_rank: int, local_world: int) -> list[tuple]:
    """(stem, the rank whose state it is, the world its JSON names, that JSON) of the files
    this local rank wrote, own states first: the node's local ranks share its files, each
    reading its own. A copy was written by the rank it was sent to; an unreadable JSON (its
    world None, the error in its place) counts as written by the rank it names, whose
    check then says why."""
    found = []
    for path in sorted(directory.glob("*.json")):
        kind, _, number = path.stem.partition("-")
        if kind not in ("rank", "copy") or not number.isdigit():
            continue
        rank, writer, world = int(number), int(number), None
        try:
            meta = json.loads(path.read_text())
            world = meta["placement"]["saved_from"]["world"]
            if kind == "copy":
                writer = partner_of(rank, world, meta.get("local_world", local_world))
        except FileNotFoundError:
            continue  # removed since listed
        except (OSError, ValueError, KeyError, TypeError) as e:
            meta = e
        if writer % local_world == local_rank:
            found.append((kind != "rank", path.with_suffix(""), rank, world, meta))
    return [f[1:] for f in sorted(found, key=lambda f: f[:2])]


def _verified(stem: Path, meta: Any, step: int, rank: int, cfg: Config, warn, layout):
    """The blob of `stem` (its JSON `meta`, read once, and .safetensors) if it is whole and
    this run's; a bad one is skipped with a warning."""
    try:
        if isinstance(meta, Exception):
            raise meta
        data = stem.with_suffix(".safetensors").read_bytes()
        check_sha(meta, data)
        check_meta(meta, step, rank, cfg, layout)
        return join(meta, data)
    except (KeyError, TypeError) as e:
        why = f"no field {e}"
    except CorruptCheckpoint as e:
        why = str(e)
    except (OSError, ValueError) as e:
        why = f"unreadable: {e}"
    warn(f"tetrad: warning: skipping the in-memory checkpoint {stem}: {why}")
    return None


def generations(root: Path) -> list[Path]:
    """Generation directories under `root`, newest first."""
    return [p for _, p in reversed(step_dirs(root))]


def prune(root: Path, committed: int) -> None:
    """Remove the generations older than `committed` (every rank committed it: nothing
    reads them now), whole: the node's other ranks' files too, and after an elastic shrink
    those of ranks the world no longer has. The node's ranks may race here: a directory
    already gone is no error."""
    for step, directory in step_dirs(root):
        if step < committed:
            shutil.rmtree(directory, ignore_errors=True)


def discard(root: Path, rank: int, source: int, step: int | None = None) -> None:
    """Remove this rank's files of generation `step` (of every one when None)."""
    for s, directory in step_dirs(root):
        if step is not None and s != step:
            continue
        for stem in (f"rank-{rank:05d}", f"copy-{source:05d}"):
            for suffix in (".json", ".safetensors"):  # the JSON first: no half a copy
                (directory / f"{stem}{suffix}").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            directory.rmdir()  # the last rank out removes it
            directory.parent.rmdir()


def clear(root: Path) -> None:
    """Remove every generation under `root` (a fresh run), and `root` if it is empty."""
    for directory in generations(root):
        shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        root.rmdir()


class BlobReader:
    """Boxes of logical tensors from every rank's in-memory state (the `read(key, box)` a
    state adapter's `load_owned` asks), assembled from the saved boxes that overlap."""

    def __init__(self, metas: list[dict], tensors: list[dict[str, torch.Tensor]]):
        self.pieces: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        for meta, named in zip(metas, tensors):
            for key, pieces in meta["slices"].items():
                for p in pieces:
                    box = tuple(tuple(b) for b in p["box"])
                    self.pieces.setdefault(key, []).append((box, named[p["key"]]))

    def shape(self, key: str) -> tuple[int, ...] | None:
        """A saved tensor's full shape, as far as its boxes reach (None: not saved)."""
        boxes = [box for box, _ in self.pieces.get(key, [])]
        return tuple(max(d) for d in zip(*[[b for _, b in box] for box in boxes])) or None

    def __call__(self, key: str, box: Box) -> torch.Tensor:
        pieces = self.pieces.get(key, [])
        dtype = pieces[0][1].dtype if pieces else torch.float32  # as saved: fp64 stays fp64
        parts = [(saved, values.__getitem__) for saved, values in pieces]
        return assemble(box, dtype, parts, f"the in-memory state misses part of {key} {box}")


def _partner_group(rank: int, world: int, timeout_s: float) -> Group:
    """Every rank, in a gloo group of its own, whatever the training's backend (a
    collective: every rank makes it, in the same order, on the training thread)."""
    ranks = list(range(world))
    timeout = timedelta(seconds=timeout_s)
    pg = dist.new_group(ranks, timeout=timeout, backend="gloo") if world > 1 else None
    return Group("partner", ranks, rank, pg)


def _where_copies(world: int, local_world: int) -> str:
    """Where each rank's copy goes, and so what it survives."""
    if world == 1:
        return "no partner (one rank: the copy survives a restart of the process only)"
    if world > local_world:  # `partner_shift`: a node's worth of ranks
        return f"each rank's copy on the rank {local_world} ahead (the next node)"
    return "each rank's copy on the next rank (one node: it survives a lost process, not the node)"


def _describe_error(error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return f"no space left in {error.filename or 'the local directory'}"
    return f"{type(error).__name__}: {error}"
