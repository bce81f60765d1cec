"""What an implementation overlaps, runs and keeps, beyond the layout itself: `Implementation`,
and the engines the planner describes (tetrad, and the published systems it is checked
against). docs/plan.md, "Engines", gives the table and the sources."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tetrad.layout import SPLIT_BACKWARD, Layout
from tetrad.plan.compute import ROUTING_IMBALANCE, Kernels


@dataclass(frozen=True)
class Implementation:
    """What an implementation hides or holds, beyond the layout itself.

    tp_overlap: share of TP traffic hidden behind compute. grad_overlap: the gradient
    reduction overlaps the last microbatch's backward (grad_overlap_pp: also when pp > 1).
    param_gather_overlap: ZeRO-1/2's post-optimizer all-gather hides behind the next
    forward. reduce_every_microbatch: gradients are reduced after every microbatch (FSDP2)
    rather than accumulated unsharded (tetrad: ZeRO-2/3 then hold full gradients).
    split_w_with_tp: the zero-bubble W is deferred for tp-sharded linears too (tetrad's
    column- and row-parallel linears split their backward; an engine without it does
    the weight gradients in B when tp > 1).
    sp_saves_shards: under SP the column-parallel linears keep their input's sequence
    shard and re-gather it for backward (Megatron); tetrad keeps the gathered input.
    kernels: fused or eager elementwise kernels and the flash-attention class
    (`plan.compute`); fused kernels also save less (`plan.activations`: a fused norm keeps
    its bf16 input and no fp32 copy, a fused SwiGLU three f-wide tensors, not four).
    chunked_loss: the head and the loss run `train.loss_chunk` tokens at a time, never
    holding full logits (tetrad).
    split: how layers go to pipeline stages: "balanced" (tetrad's `layer_split`, on
    analytic costs) or "uniform" (Megatron: L/S layers a stage; where S does not divide L
    but divides L + 2, `--account-for-embedding-in-pipeline-split` and
    `--account-for-loss-in-pipeline-split` count the embedding and the loss as a layer
    each, so the first and last stages hold one layer fewer; otherwise balanced).
    max_live_params: elements of gathered ZeRO-3 parameters kept at once (DeepSpeed's
    `stage3_max_live_parameters`; 0: whole units, two blocks and the root); gradients
    awaiting reduction are then two `reduce_bucket`s.
    cp_overlap: context parallelism's key/value exchange runs beside attention (a ring
    whose next block's transfer overlaps this block's compute: Megatron through
    Transformer Engine, torchtitan); tetrad's default all-gather core waits for it.
    cp_gathers_kv: attention keeps the all-gathered keys and values of the whole
    sequence for its backward (tetrad's all-gather core); a ring keeps only its own.
    interleaved_lag: warm-up forwards of the interleaved schedule per downstream rank:
    2 (Megatron, tetrad) also covers a p2p round trip, at L·(1 + (p-1)/(p·v)) layers of
    activations on rank 0; 1 holds 1F1B's L (an engine that overlaps its transfers
    otherwise: Llama 3's asynchronous p2p).
    zero_blocks: ZeRO blocks alive at the memory peak, (gathered parameters, unsharded
    gradients): FSDP's (2, 2), one prefetched while one computes; tetrad's (1, 0)
    (`Footprint._zero_buffers`). zero3_incoming_grad: under ZeRO-3 with gradients
    accumulated whole, a microbatch's gradient of the unit in backward arrives as a new
    flat tensor before it is added to the accumulated one (tetrad re-splits the
    parameters at every gather).
    shards_over_cp: the ZeRO state is sharded over fsdp x cp (torchtitan's FSDP mesh takes
    the cp ranks in: they hold the same weights), at fsdp 1 too, where it is sharded over
    the cp ranks alone (torchtitan's dp_shard x cp mesh at dp_shard 1); tetrad shards over
    fsdp alone. Memory only: the traffic is still priced over the fsdp group (none at
    fsdp 1).
    eager_loss: the loss is eager `F.cross_entropy` on the logits cast to fp32, the logits
    freed before the backward (torchtitan's `loss_fn` and `del pred`; under tp DTensor's
    loss_parallel): its backward holds one fp32 N·V/t tensor more under tp, and the freed
    compute-dtype logits stay reserved (`plan.peak.eager_loss_backward`, `eager_loss_hole`).
    pp_no_sync: under pp, ZeRO-2/3 as torch's pipelining runs FSDP2
    (`PipelineStage.backward_maybe_with_nosync`: no resharding after backward and no
    gradient reduction until a stage's last backward; torchtitan also turns
    reshard_after_forward off under pp): the stage's weights stay gathered from its first
    forward to the step and its gradients accumulate whole, in the reduce dtype (fp32).
    Memory only: the traffic is priced as `reduce_every_microbatch` says.
    reduce_async: with reduce_every_microbatch, a microbatch's reduction runs beside the
    rank's next compute, forward included, not only its own backward: only the last
    microbatch's last unit waits at the end of the step (Llama 3's FSDP).
    ep_inner: the ep group takes the innermost ranks (tp first, then the data ranks:
    Megatron's expert mesh with expert tp 1); tetrad's takes the data ranks first
    (`mesh.expert_groups`). ep_dedup: a token's copies bound for one node cross the
    network once and fan out over NVLink there (DeepEP's internode kernels).
    ep_overlap: the dispatch and combine of one microbatch run beside another
    microbatch's compute (Megatron's 1F1B all-to-all overlap); only what they take beyond
    it shows. routing_imbalance: copies the most loaded ep rank receives over the mean
    (`plan.compute.ROUTING_IMBALANCE`; 1: forced balance).
    shares_tables: what a family names `SHARED_ACROSS_MICROBATCHES` (tetrad's rotary
    tables, made once per layer and kept) is held once by a stage's microbatches in flight,
    not once each.
    """

    name: str
    tp_overlap: float = 0.0
    grad_overlap: bool = True
    grad_overlap_pp: bool = False
    param_gather_overlap: bool = False
    reduce_every_microbatch: bool = False
    split_w_with_tp: bool = False
    sp_saves_shards: bool = False
    kernels: Kernels = Kernels()
    gather_bucket: float = 0.0
    reduce_bucket: float = 0.0
    gather_overlap: bool = True
    chunked_loss: bool = False
    split: str = "balanced"
    max_live_params: float = 0.0
    cp_overlap: bool = False
    cp_gathers_kv: bool = True
    interleaved_lag: int = 2
    shards_over_cp: bool = False
    zero_blocks: tuple[int, int] = (2, 2)
    zero3_incoming_grad: bool = False
    eager_loss: bool = False
    pp_no_sync: bool = False
    reduce_async: bool = False
    ep_inner: bool = False
    ep_dedup: bool = False
    ep_overlap: bool = False
    routing_imbalance: float = ROUTING_IMBALANCE
    shares_tables: bool = False

    def defers_w(self, lay: Layout) -> bool:
        """Whether `lay`'s schedule's W actions hold deferred weight gradients."""
        return lay.schedule in SPLIT_BACKWARD and (lay.tp == 1 or self.split_w_with_tp)


# Share of TP traffic an overlapping implementation hides (Megatron's --tp-comm-overlap,
# torchtitan's async TP): a stated fit on the development rows (docs/plan.md).
TP_OVERLAP = 0.8

TETRAD = Implementation("tetrad", chunked_loss=True, split_w_with_tp=True, zero_blocks=(1, 0),
                        zero3_incoming_grad=True, shares_tables=True)  # fmt: skip
MEGATRON = Implementation(  # --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap, TE
    "megatron", tp_overlap=TP_OVERLAP, grad_overlap_pp=True, param_gather_overlap=True,
    split_w_with_tp=True, sp_saves_shards=True, kernels=Kernels(True, "fa3", gqa_native=True),
    split="uniform", cp_overlap=True, cp_gathers_kv=False, ep_inner=True,
)  # fmt: skip
# Megatron-LM with DeepEP's dispatcher (--moe-token-dispatcher-type flex), and with its
# all-to-all overlapped across microbatches (--overlap-moe-expert-parallel-comm)
MEGATRON_DEEPEP = dataclasses.replace(MEGATRON, name="megatron-deepep", ep_dedup=True)
MEGATRON_EP_OVERLAP = dataclasses.replace(
    MEGATRON_DEEPEP, name="megatron-deepep-overlap", ep_overlap=True
)
# Megatron-FSDP (--use-megatron-fsdp, ZeRO-3) with DeepEP: gradients reduce-scattered into
# their shards after every microbatch, not accumulated whole
MEGATRON_FSDP = dataclasses.replace(
    MEGATRON_DEEPEP, name="megatron-fsdp", reduce_every_microbatch=True
)
TORCHTITAN = Implementation("torchtitan", grad_overlap_pp=True, reduce_every_microbatch=True,
                    cp_overlap=True, cp_gathers_kv=False, shards_over_cp=True,
                    eager_loss=True, pp_no_sync=True)  # fmt: skip
TORCHTITAN_COMPILE = dataclasses.replace(
    TORCHTITAN, name="torchtitan-compile", kernels=Kernels(fused=True)
)
# async TP is a torch.compile pass in torchtitan: compiled kernels as well
TORCHTITAN_ASYNC_TP = dataclasses.replace(
    TORCHTITAN_COMPILE, name="torchtitan-async-tp", tp_overlap=TP_OVERLAP
)
# DeepSpeed ZeRO-3 (with Megatron's fused kernels, as Megatron-DeepSpeed runs it): gathers
# in prefetch buckets of 5e7 elements, reduces every micro-step in buckets of 5e8
# (the defaults of `stage3_prefetch_bucket_size` and `reduce_bucket_size`), and keeps at
# most 1e9 gathered elements (`stage3_max_live_parameters`)
DEEPSPEED = Implementation(
    "deepspeed", grad_overlap_pp=True, reduce_every_microbatch=True,
    kernels=Kernels(fused=True), gather_bucket=5e7, reduce_bucket=5e8, gather_overlap=False,
    max_live_params=1e9,
)  # fmt: skip
# Megatron-LM as Narayanan et al. (2021) ran PTD-P: fused kernels (layer norm, bias-GeLU,
# scale-mask-softmax) but no flash attention (it came in 2022) and no sequence
# parallelism, TP and gradient all-reduces not overlapped (the all-reduce after the
# pipeline flush), the uniform split, the interleaved schedule
MEGATRON_2021 = Implementation(
    "megatron-2021", grad_overlap=False, kernels=Kernels(True, "unfused"), split="uniform",
    split_w_with_tp=True,
)  # fmt: skip
# Llama 3's own 4D training stack as its paper describes it (Llama 3 Herd, section 3.3.2):
# Megatron-class fused kernels and sequence shards, one layer fewer on the first and last
# stages (the uniform split with the embedding and the loss counted), asynchronous p2p
# with an interleaved schedule that keeps fewer warm-up microbatches than Megatron's,
# FSDP that keeps gradients sharded (reduce-scattered in fp32 as each microbatch's
# backward makes them, asynchronously: beside the next microbatch's work) and the bf16
# weights whole through the step (ZeRO-2), and context parallelism that all-gathers the
# keys and values instead of a ring (not overlapped). Assumed, where the paper is silent
# (docs/plan.md): the state sharded over the data and cp ranks as torchtitan's, the
# gathered keys and values not kept for backward, FlashAttention-2-class kernels (the
# run predates FlashAttention-3)
LLAMA3 = dataclasses.replace(
    MEGATRON, name="llama3", interleaved_lag=1, reduce_every_microbatch=True,
    reduce_async=True, shards_over_cp=True, cp_overlap=False,
    kernels=Kernels(True, "fa2", gqa_native=True),
)  # fmt: skip
ENGINES = {
    e.name: e
    for e in (TETRAD, MEGATRON, MEGATRON_DEEPEP, MEGATRON_EP_OVERLAP, MEGATRON_FSDP,
              MEGATRON_2021,
              TORCHTITAN, TORCHTITAN_COMPILE, TORCHTITAN_ASYNC_TP, DEEPSPEED, LLAMA3)
}  # fmt: skip
