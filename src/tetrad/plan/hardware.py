"""Devices and clusters the planner knows: declared peaks, memory, links, GEMM efficiency.

Every number here is a vendor specification or a published measurement (the sources are
in the reference notes and docs/plan.md), except `GEMM_EFFICIENCY`: the share of the
dense peak a training step's large GEMMs reach on that device kind, fitted once per kind
and stated in docs/plan.md (with `plan.compute.GEMM_HALF_WIDTH` and `plan.engines.TP_OVERLAP`,
the planner's only fitted constants).

Links follow the alpha-beta model: a collective over n ranks on a buffer of S bytes takes
`alpha * steps + bus_bytes / bw`, with a ring's steps and bus bytes (all-reduce 2(n-1)
steps and 2(n-1)/n·S bytes; all-gather and reduce-scatter n-1 and (n-1)/n·S; send/recv 1
and S) and `bw` the achieved bus bandwidth per GPU (what nccl-tests calls busbw). A
`tetrad bench comm` JSON replaces a link's alpha and bw by the measured ones, per op.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from tetrad.comm import bus_factor
from tetrad.devices import A100, H100, H100_HBM2E, H200, Device, GiB, cpu_core_tflops

RING = {  # op -> steps of a ring over n ranks (its bus bytes per buffer byte: `bus_factor`)
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "send_recv": lambda n: 1,
}


@dataclass(frozen=True)
class Link:
    """One kind of link as one GPU sees it, and the group a collective runs over.

    bw_Bps: achieved bus bandwidth per GPU (bytes/s); line_Bps: the line rate per
    direction it achieves that share of (0: unknown). Latency follows NCCL's own tuning
    model (`src/graph/tuning.cc`, Simple protocol): `base_s` per call, `alpha_s` per ring
    step on this link kind; when the group spans `nodes` > 1 nodes, the ring's steps that
    cross a node (nodes - 1 of them for all-gather and reduce-scatter, twice that for
    all-reduce) cost `alpha_s` and the others `intra_alpha_s`. Across more than two
    nodes an all-reduce may run as NCCL's double binary tree instead, with latency
    `base + 2·((ppn - 1)·intra + log2(nodes)·alpha)` at 0.9 of the ring's bandwidth;
    the faster of the two is taken, as NCCL's tuner does.
    measured: per-op (alpha per call, bus bandwidth) from a `tetrad bench comm` fit; it
    takes precedence for the ops it has.
    """

    name: str
    alpha_s: float
    bw_Bps: float
    line_Bps: float = 0.0
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)
    base_s: float = 0.0
    nodes: int = 1
    intra_alpha_s: float = 0.0

    def time(self, op: str, n: int, nbytes: float) -> float:
        """Seconds for `op` over `n` ranks on a buffer of `nbytes` (the full buffer)."""
        if n <= 1 and op != "send_recv":
            return 0.0
        steps, bus = RING[op], bus_factor(op, n)
        if op in self.measured:
            alpha, bw = self.measured[op]
            return alpha + bus * nbytes / bw
        transfer = bus * nbytes / self.bw_Bps
        nodes = min(self.nodes, n) if op != "send_recv" else 1
        if nodes <= 1:
            return self.base_s + self.alpha_s * steps(n) + transfer
        inter = (nodes - 1) * (2 if op == "all_reduce" else 1)
        ring = self.base_s + (steps(n) - inter) * self.intra_alpha_s + inter * self.alpha_s
        if op != "all_reduce" or nodes <= 2:
            return ring + transfer
        ppn = max(n // nodes, 1)
        tree = self.base_s + 2 * ((ppn - 1) * self.intra_alpha_s + math.log2(nodes) * self.alpha_s)
        return min(ring + transfer, tree + transfer / TREE_BW_SHARE)


@dataclass(frozen=True)
class Cluster:
    """Identical devices, `gpus_per_node` to a node: `intra` links inside a node, `inter`
    between nodes (one NIC per GPU)."""

    device: Device
    gpus_per_node: int
    intra: Link
    inter: Link
    sized: bool = True  # GEMM rates fall with small matrices (plan.compute); not for cpu
    # lowest and highest efficiency, over the fitted one, among the rows (or runs) it was
    # fitted to: a prediction's range (Planner.with_range)
    spread: tuple[float, float] = (1.0, 1.0)
    # communication runs beside compute (GPU: copy engines and spare SMs); False on a CPU
    # whose every core computes: gloo's transfers then take turns with the compute
    overlap: bool = True
    # the cores that run the GEMMs also run the elementwise work (a CPU: small tensors
    # stay in cache, and the ops are bound by the core, not by DRAM): its bandwidth moves
    # with the efficiency (`at_efficiency`)
    core_bound: bool = False

    def link(self, stride: int, size: int) -> Link:
        """The link a collective over `size` ranks `stride` apart runs at.

        Ranks fill nodes in order, so the group stays in a node iff it spans at most
        `gpus_per_node` consecutive ranks: NVLink. Otherwise its ring crosses nodes, and
        NCCL runs one ring channel per NIC: a node with k members of the group (each GPU
        with its own NIC; the node's other groups use the other NICs) moves its share
        over k NICs, so the bus bandwidth is k NICs' worth, at most NVLink's.
        """
        if stride * size <= self.gpus_per_node:
            return self.intra
        k = max(1, min(size, self.gpus_per_node // max(stride, 1)))
        nodes = math.ceil(size / k)
        out = replace(self.inter, nodes=nodes, intra_alpha_s=self.intra.alpha_s)
        if k == 1 or self.inter.measured:
            return out
        return replace(out, bw_Bps=min(self.intra.bw_Bps, k * self.inter.bw_Bps))

    def group_link(self, ranks: list[int]) -> Link:
        """The link a collective over these global ranks (ascending) runs at: NVLink when
        they share a node, else as `link` prices a group of their first stride."""
        if ranks[-1] // self.gpus_per_node == ranks[0] // self.gpus_per_node:
            return self.intra  # a lone rank too: the group has a second rank below
        return self.link(ranks[1] - ranks[0], len(ranks))

    def all_to_all(self, ranks: list[int], nbytes: float, leaving: float = 1.0) -> float:
        """Seconds of an all-to-all over these global ranks in which each sends `nbytes`
        spread evenly over the group ((n - 1)/n of it leaves the rank).

        Every pair exchanges at once (NCCL posts all the sends and receives of one call
        together), so the latency is one call on the slowest link kind the group spans,
        and the transfer the slower of the two paths: what stays in the node over NVLink,
        what leaves it over the rank's own NIC (each GPU has one), `leaving` times the
        even share (a dispatcher that sends a token once per node sends less)."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        node = ranks[0] // self.gpus_per_node
        local = sum(1 for r in ranks if r // self.gpus_per_node == node)
        inside = (local - 1) / n * nbytes / self.intra.bw_Bps
        if local == n:
            return self.intra.base_s + self.intra.alpha_s + inside
        outside = (n - local) / n * nbytes * leaving / self.inter.bw_Bps
        return self.inter.base_s + self.inter.alpha_s + max(inside, outside)

    def p2p_link(self, distance: int) -> Link:
        """The link between two ranks `distance` apart (a pipeline boundary): one NIC when
        they sit on different nodes."""
        return self.intra if distance < self.gpus_per_node else self.inter


def at_efficiency(cluster: Cluster, efficiency: float) -> Cluster:
    """`cluster` with its device's GEMM efficiency set to `efficiency`; on a core-bound
    device the elementwise bandwidth scales by the same factor."""
    dev = cluster.device
    bw = dev.hbm_Bps * efficiency / dev.efficiency if cluster.core_bound else dev.hbm_Bps
    return replace(cluster, device=replace(dev, efficiency=efficiency, hbm_Bps=bw))


# --- presets ------------------------------------------------------------------------------

# NCCL's tuning model, Simple protocol: 8.4 us a call; a ring step 3.4 us on NVLink, 14 us
# across the network (the tree's network step is the same 14 us)
NCCL_BASE, NCCL_NVLINK_STEP, NCCL_NET_STEP = 8.4e-6, 3.4e-6, 14e-6
TREE_BW_SHARE = 0.9  # NCCL's tree runs at 0.9 of the ring's bus bandwidth
NVLINK4 = Link("nvlink4", NCCL_NVLINK_STEP, 370e9, 450e9, base_s=NCCL_BASE)  # ~370 of 450 GB/s
NVLINK3 = Link("nvlink3", NCCL_NVLINK_STEP, 230e9, 300e9, base_s=NCCL_BASE)  # 8xA100 busbw ~230
IB_NDR = Link("ib-ndr", NCCL_NET_STEP, 47e9, 50e9, base_s=NCCL_BASE)  # 400 Gb/s: 46-48 GB/s
IB_HDR = Link("ib-hdr", NCCL_NET_STEP, 23.5e9, 25e9, base_s=NCCL_BASE)  # 200 Gb/s: the same 94%
# gloo on this machine's loopback (docs/results/comm_nproc2.json, 2 ranks): all-reduce
# ~0.7 ms per call, i.e. 2 ring steps; ~0.76 GB/s bus bandwidth
GLOO_LOOPBACK = Link("gloo-loopback", 3.5e-4, 0.76e9)

# Share of the dense peak large GEMMs reach within a training step, by device kind
# (attention and elementwise work are priced apart, plan.compute): the median over the
# development rows of each kind of the share that reproduces the row (docs/plan.md,
# "Efficiency"); H200 takes H100's (same die and clocks, no bf16 row to check).
GEMM_EFFICIENCY = {"h100": 0.62, "h100-hbm2e": 0.50, "a100": 0.72, "h200": 0.62}
# the lowest and highest implied efficiency of those rows over the median (docs/plan.md)
SPREAD = {"h100": (0.87, 1.18), "h100-hbm2e": (0.91, 1.11), "a100": (0.89, 1.04),
          "h200": (0.87, 1.18)}  # fmt: skip


CLUSTERS = {
    d.name: Cluster(replace(d, efficiency=GEMM_EFFICIENCY[d.name]), 8, link, ib,
                    spread=SPREAD[d.name])
    for d, link, ib in ((H100, NVLINK4, IB_NDR), (H100_HBM2E, NVLINK4, IB_NDR),
                        (H200, NVLINK4, IB_NDR), (A100, NVLINK3, IB_HDR))
}  # fmt: skip


def cpu_cluster() -> Cluster:
    """This machine: one rank per core (gloo, one thread each), RAM shared by the cores."""
    cores = os.cpu_count() or 1
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 8 * GiB
    peak = cpu_core_tflops()
    # efficiency: tetrad's own single-process runs of the small models here reach about a
    # quarter of the declared one-core peak (metrics.jsonl mfu); stated, not fitted
    peaks = {"fp32": peak, "bf16": peak, "fp64": peak / 2}  # fp64: half the SIMD lanes
    device = Device("cpu", peaks, mem / cores, 10e9, 0.25, 0.25 * GiB)
    # spread: the measured steps of docs/plan.md's table, -25% to +30% of the predicted
    return Cluster(device, cores, GLOO_LOOPBACK, GLOO_LOOPBACK, sized=False, spread=(0.75, 1.3),
                   overlap=False, core_bound=True)  # fmt: skip


def cluster_preset(name: str) -> Cluster:
    """A named cluster: h100, h100-hbm2e, h200, a100 (8 GPUs a node), or cpu (this machine)."""
    if name == "cpu":
        return cpu_cluster()
    if name not in CLUSTERS:
        raise ValueError(f"unknown device {name!r}; known: {sorted(CLUSTERS) + ['cpu']}")
    return CLUSTERS[name]


def calibrated(cluster: Cluster, bench_json: str | Path) -> Cluster:
    """`cluster` with both links replaced by the alpha-beta fits of a `tetrad bench comm`
    JSON (one machine: the same measured link inside and between nodes)."""
    report = json.loads(Path(bench_json).read_text())
    fits = report.get("alpha_beta")
    if not isinstance(fits, dict) or not fits:
        raise ValueError(f"{bench_json}: no 'alpha_beta' table (is it `tetrad bench comm` JSON?)")
    measured = {}
    for op, fit in fits.items():
        busbw = fit.get("busbw_beta_Bps")
        if op in RING and busbw:
            measured[op] = (float(fit["alpha_s"]), float(busbw))
    if not measured:
        raise ValueError(f"{bench_json}: no usable alpha-beta fit among {sorted(fits)}")
    name = f"measured-{report.get('backend', '?')}"
    intra = replace(cluster.intra, name=name, measured=measured)
    inter = replace(cluster.inter, name=name, measured=measured)
    return replace(cluster, intra=intra, inter=inter)
