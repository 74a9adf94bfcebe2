"""One parallel layout: every degree, its rules checked once, derived sizes as properties.

In the spirit of torchtitan's ``ParallelDims``. Taken by the trainer's validation, the rank map,
migrate, the communication planner and perf-report; no torch import, so the CLIs start fast.
Each rule raises ``LayoutError`` naming the flags to change, spelled as the caller's command
spells them (``LayoutFlags``: ``--tp`` for rankmap/plan, ``--tensor-model-parallel-size`` for
pretrain_gpt.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any


class LayoutError(ValueError):
    """A layout that does not fit the cluster; the message says why and what fits."""


@dataclass(frozen=True)
class LayoutFlags:
    """How one command spells each degree, so a message names the flag the user typed."""

    tp: str = "--tp"
    pp: str = "--pp"
    cp: str = "--cp"
    ep: str = "--ep"
    etp: str = "--etp"
    num_experts: str = "--num-experts"
    vpp: str = "--vpp"
    num_layers: str = "--num-layers"
    nnodes: str = "--nnodes"
    nproc_per_node: str = "--nproc-per-node"
    devices_per_node: str = "--devices-per-node"
    global_batch_size: str = "--global-batch-size"
    micro_batch_size: str = "--micro-batch-size"


LAUNCH_FLAGS = LayoutFlags()
TRAINER_FLAGS = LayoutFlags(
    tp="--tensor-model-parallel-size",
    pp="--pipeline-model-parallel-size",
    cp="--context-parallel-size",
    ep="--expert-model-parallel-size",
    etp="--expert-tensor-parallel-size",
    vpp="--num-virtual-stages-per-pipeline-rank",
)


def layout_stages(layout: str) -> list[str]:
    """The virtual stages of --pipeline-model-parallel-layout ("|"-separated, each a string of E embedding,
    t decoder layer, m MTP layer, L loss), after megatron-core's unrolling of ``(...)*n``, then ``x*n``."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _layout_virtual_stages(layout: str, pp: int, per_vstage: Any, vstages: Any) -> int | None:
    """The virtual stages of --pipeline-model-parallel-layout: its stages ("|"-separated, after
    megatron-core's unrolling of ``(...)*n`` and ``x*n``) over PP (Megatron-LM's validate_args)."""
    if per_vstage is not None or vstages is not None:
        raise LayoutError(
            "--pipeline-model-parallel-layout sets the virtual stages itself: drop "
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
        )
    stages = len(layout_stages(layout))
    if stages % pp:
        raise LayoutError(
            f"--pipeline-model-parallel-layout {layout!r} has {stages} stages, not a multiple of "
            f"--pipeline-model-parallel-size {pp}"
        )
    return stages // pp


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def arg_value(args: Any, key: str, default: Any = None) -> Any:
    """``args.key`` of a Namespace or ``args[key]`` of a dict (args.json), else ``default``."""
    if isinstance(args, Mapping):
        value = args.get(key, default)
    else:
        value = getattr(args, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class LayerSplit:
    """How the layers are split over pipeline stages when not evenly (ParallelDims' fields of the same names)."""

    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    embedding_in_split: bool = False
    loss_in_split: bool = False
    layout: str | None = None


@dataclass(frozen=True)
class ParallelDims:
    """A validated layout. ``nproc_per_node`` None: ranks per node unknown (no TP-in-node rule);
    ``devices_per_node`` None: the hardware is not known (migrate knows it: --npus-per-node)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    nnodes: int = 1
    nproc_per_node: int | None = None
    devices_per_node: int | None = None
    num_layers: int | None = None
    flags: LayoutFlags = field(default=LAUNCH_FLAGS, compare=False, repr=False)
    #: expert tensor parallel (megatron-core's expert_tensor_parallel_size); None: the same as TP
    etp: int | None = None
    #: experts per MoE layer; 0: a dense model (EP must then be 1); None: not known (rankmap, plan)
    num_experts: int | None = None
    #: uneven pipeline stages: layers of the first / last stage (the rest split evenly over the middle)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    #: the embedding / the loss counted as one layer each when splitting the layers over stages
    embedding_in_split: bool = False
    loss_in_split: bool = False
    #: --pipeline-model-parallel-layout (its own stages: vpp follows from it)
    layout: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def for_launch(
        cls,
        world_size: int | None = None,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        vpp: int | None = None,
        *,
        nnodes: int | None = None,
        nproc_per_node: int | None = None,
        devices_per_node: int | None = None,
        num_layers: int | None = None,
        flags: LayoutFlags = LAUNCH_FLAGS,
        etp: int | None = None,
        num_experts: int | None = None,
        split: LayerSplit | None = None,
    ) -> ParallelDims:
        """A torchrun launch: world size from nnodes x nproc_per_node, or one node holding every rank."""
        if nnodes is not None and nproc_per_node is not None:
            if world_size is not None and world_size != nnodes * nproc_per_node:
                raise LayoutError(
                    f"world_size {world_size} != {flags.nnodes} {nnodes} x {flags.nproc_per_node} {nproc_per_node}"
                )
            if nnodes < 1 or nproc_per_node < 1:
                raise LayoutError(f"{flags.nnodes} and {flags.nproc_per_node} must be >= 1")
            world = nnodes * nproc_per_node
        elif world_size is None:
            raise LayoutError(f"give the world size, or {flags.nnodes} and {flags.nproc_per_node}")
        else:
            world, nnodes, nproc_per_node = world_size, 1, world_size
        degrees = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vpp, "etp": etp, "num_experts": num_experts}
        placement = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "devices_per_node": devices_per_node}
        return cls._build(world, degrees, placement, num_layers, flags, split)

    @classmethod
    def _build(
        cls,
        world_size: int,
        degrees: Mapping[str, int | None],
        placement: Mapping[str, int | None],
        num_layers: int | None,
        flags: LayoutFlags,
        split: LayerSplit | None,
    ) -> ParallelDims:
        """The one constructor call of for_launch and from_args: every field by its name."""
        return cls(
            world_size=world_size,
            num_layers=num_layers,
            flags=flags,
            **degrees,  # type: ignore[arg-type]
            **placement,  # type: ignore[arg-type]
            **asdict(split or LayerSplit()),
        )

    @classmethod
    def from_args(
        cls,
        args: Any,
        world_size: int,
        flags: LayoutFlags = TRAINER_FLAGS,
        *,
        nnodes: int = 1,
        nproc_per_node: int | None = None,
        devices_per_node: int | None = None,
    ) -> ParallelDims:
        """pretrain_gpt.py's flags (a Namespace, or args.json as a dict): virtual stages come from
        --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank.
        The placement (``nnodes``, ``nproc_per_node``, ``devices_per_node``) is optional: given, its
        rules are checked too (migrate knows a script's launcher and the node's NPUs)."""
        tp, pp, cp = (
            int(arg_value(args, k, 1))
            for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        )
        num_layers = arg_value(args, "num_layers")
        per_vstage = arg_value(args, "num_layers_per_virtual_pipeline_stage")
        vstages = arg_value(args, "num_virtual_stages_per_pipeline_rank")
        vpp = arg_value(args, "virtual_pipeline_model_parallel_size")  # args.json: already derived
        if per_vstage is not None and vstages is not None:
            raise LayoutError(
                "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                "are mutually exclusive; give one"
            )
        if per_vstage is not None:
            flags = replace(flags, vpp="--num-layers-per-virtual-pipeline-stage")
            if num_layers is not None and pp > 0 and num_layers % pp == 0:
                per_stage = num_layers // pp
                if per_vstage <= 0 or per_stage % per_vstage != 0:
                    raise LayoutError(
                        f"layers per pipeline stage ({num_layers} / {pp} = {per_stage}) is not divisible "
                        f"by --num-layers-per-virtual-pipeline-stage {per_vstage}"
                    )
                vpp = per_stage // per_vstage
        elif vstages is not None:
            vpp = vstages
        layout = arg_value(args, "pipeline_model_parallel_layout")
        if layout is not None:
            vpp = _layout_virtual_stages(layout, pp, per_vstage, vstages)
        if vpp == 1:
            vpp = None  # one virtual stage is no interleaving (Megatron-LM)
        ep = int(arg_value(args, "expert_model_parallel_size", 1))
        etp = arg_value(args, "expert_tensor_parallel_size")
        experts = arg_value(args, "num_experts")
        split = LayerSplit(
            first_stage_layers=arg_value(args, "decoder_first_pipeline_num_layers"),
            last_stage_layers=arg_value(args, "decoder_last_pipeline_num_layers"),
            embedding_in_split=bool(arg_value(args, "account_for_embedding_in_pipeline_split", False)),
            loss_in_split=bool(arg_value(args, "account_for_loss_in_pipeline_split", False)),
            layout=layout,
        )
        degrees = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vpp, "etp": etp, "num_experts": experts or 0}
        placement = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "devices_per_node": devices_per_node}
        return cls._build(world_size, degrees, placement, num_layers, flags, split)

    # ---- rules --------------------------------------------------------------------------------
    def _validate(self) -> None:
        f = self.flags
        if self.world_size <= 0:
            raise LayoutError(f"world size must be positive, got {self.world_size}")
        for flag, value in ((f.tp, self.tp), (f.pp, self.pp), (f.cp, self.cp), (f.ep, self.ep)):
            if value < 1:
                raise LayoutError(f"{flag} must be >= 1, got {value}")
        nproc, devices = self.nproc_per_node, self.devices_per_node
        if devices is not None and nproc is not None and nproc > devices:
            raise LayoutError(
                f"the launcher starts {nproc} processes per node but a node has {devices} devices "
                f"({f.devices_per_node})"
            )
        # TP communicates every layer: its group (contiguous ranks) must stay on one node's fast links
        if devices is not None and (self.tp > devices or devices % self.tp):
            raise LayoutError(
                f"TP={self.tp} does not fit in a node of {devices} devices: TP communicates every "
                f"layer and must stay on a node's HCCS links ({f.tp})"
            )
        model = self.tp * self.pp * self.cp
        if nproc is not None and (self.tp > nproc or nproc % self.tp):
            rest = self.pp * self.cp
            fits = [d for d in divisors(nproc) if self.world_size % rest == 0 and (self.world_size // rest) % d == 0]
            raise LayoutError(
                f"TP={self.tp} would span nodes: a TP group is {self.tp} contiguous ranks and a node holds "
                f"{nproc}; TP communicates every layer and must stay on a node's HCCS links. "
                f"TP sizes that fit: {', '.join(map(str, fits or divisors(nproc)))} ({f.tp})"
            )
        if self.world_size % model:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by {f.tp} {self.tp} x {f.pp} {self.pp} x "
                f"{f.cp} {self.cp} = {model}; TP x PP x CP must be one of "
                f"{', '.join(map(str, divisors(self.world_size)))}"
            )
        self._validate_experts()
        if self.vpp is not None:
            if self.vpp < 1:
                raise LayoutError(f"{f.vpp} must be >= 1, got {self.vpp}")
            if self.pp < 2:
                raise LayoutError(f"{f.vpp} (interleaved schedule) needs {f.pp} > 1")
        if self.num_layers is not None:
            self.check_num_layers(self.num_layers)

    def _validate_experts(self) -> None:
        """megatron-core (0.16) lays the MoE layers out on their own grid, ETP x EP x expert-DP x PP
        ("MoE parallel folding"): EP and expert TP need not divide the attention's DP, only the world."""
        f = self.flags
        if self.etp is not None and self.etp < 1:
            raise LayoutError(f"{f.etp} must be >= 1, got {self.etp}")
        if self.num_experts == 0 and self.ep > 1:
            raise LayoutError(f"{f.ep} {self.ep} needs {f.num_experts} (a dense model has no experts)")
        if self.num_experts is not None and self.num_experts < 0:
            raise LayoutError(f"{f.num_experts} must be >= 1, got {self.num_experts}")
        if self.num_experts and self.num_experts % self.ep:
            raise LayoutError(
                f"{f.num_experts} {self.num_experts} is not divisible by {f.ep} {self.ep}: every EP rank holds "
                f"the same number of experts; EP sizes that fit: {', '.join(map(str, self._fitting_ep()))}"
            )
        grid = self.expert_tp * self.ep * self.pp
        if self.world_size % grid:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by {f.etp} {self.expert_tp} x {f.ep} {self.ep} x "
                f"{f.pp} {self.pp} = {grid} (the experts' grid); EP sizes that fit: "
                f"{', '.join(map(str, self._fitting_ep()))}"
            )

    def _fitting_ep(self) -> list[int]:
        candidates = divisors(self.num_experts) if self.num_experts else divisors(self.world_size)
        return [e for e in candidates if self.world_size % (self.expert_tp * e * self.pp) == 0]

    def check_num_layers(self, num_layers: int) -> None:
        """PP (x virtual stages) must divide the layers; with uneven first / last stages the middle
        stages' layers (megatron-core's TransformerConfig rules, said before any process group)."""
        f = self.flags
        if self.layout is not None:
            return  # megatron-core checks the layout's layers against --num-layers (TransformerConfig)
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            self._check_uneven_stages(num_layers)
            return
        counted = int(self.embedding_in_split) + int(self.loss_in_split)
        num_layers += counted  # --account-for-embedding/loss-in-pipeline-split: each counts as a layer
        if num_layers % self.pp:
            plus = f" + {counted} (embedding / loss counted as layers)" if counted else ""
            raise LayoutError(f"{f.num_layers} {num_layers - counted}{plus} is not divisible by {f.pp} {self.pp}")
        per_stage = num_layers // self.pp
        if self.vpp is not None and per_stage % self.vpp:
            raise LayoutError(
                f"layers per pipeline stage ({num_layers} / {self.pp} = {per_stage}) is not divisible "
                f"by {f.vpp} {self.vpp}"
            )

    def _check_uneven_stages(self, num_layers: int) -> None:
        if self.embedding_in_split or self.loss_in_split:
            raise LayoutError(
                "--decoder-first/last-pipeline-num-layers cannot be combined with "
                "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split; give one way"
            )
        middle_layers, middle_stages = num_layers, self.pp
        for flag, layers in (
            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
            ("--decoder-last-pipeline-num-layers", self.last_stage_layers),
        ):
            if layers is None:
                continue
            if layers <= 0:
                raise LayoutError(f"{flag} must be positive, got {layers}")
            if self.vpp is not None and layers % self.vpp:
                raise LayoutError(f"{flag} {layers} is not divisible by {self.flags.vpp} {self.vpp}")
            middle_layers -= layers
            middle_stages -= 1
        if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise LayoutError(
                f"--num-layers {num_layers} leaves {middle_layers} layers for {max(middle_stages, 0)} middle "
                f"pipeline stages after the first / last stage's ({self.flags.pp} {self.pp})"
            )
        if middle_stages and middle_layers % middle_stages:
            raise LayoutError(
                f"the {middle_layers} layers between the first and last stage are not divisible by the "
                f"{middle_stages} middle stages ({self.flags.pp} {self.pp})"
            )
        if middle_stages and self.vpp is not None and (middle_layers // middle_stages) % self.vpp:
            raise LayoutError(
                f"layers per middle pipeline stage ({middle_layers // middle_stages}) is not divisible by "
                f"{self.flags.vpp} {self.vpp}"
            )

    def check_seq_length(self, seq_length: int, sequence_parallel: bool) -> None:
        """CP splits the sequence; sequence parallelism splits it again over TP."""
        f = self.flags
        if self.cp > 1 and seq_length % (2 * self.cp):
            # megatron-core's get_batch_on_this_cp_rank: 2 x CP chunks, two per rank (causal load balance)
            raise LayoutError(f"--seq-length {seq_length} is not divisible by 2 x {f.cp} {self.cp} = {2 * self.cp}")
        if sequence_parallel and self.tp > 1 and seq_length % self.tp:
            raise LayoutError(f"--sequence-parallel needs --seq-length {seq_length} divisible by {f.tp} {self.tp}")

    def check_context_parallel(
        self,
        comm_types: list[str],
        hierarchical_sizes: list[int] | None,
        heads: int,
        query_groups: int,
        num_layers: int | None = None,
    ) -> None:
        """--cp-comm-type (one, or one per layer) and --hierarchical-context-parallel-sizes: the
        all-to-all splits each TP rank's heads and query groups over its ranks (CP for a2a, the first
        hierarchical size for a2a+p2p); the hierarchical sizes (a2a, p2p) multiply to CP."""
        f = self.flags
        known = ("p2p", "a2a", "a2a+p2p")
        unknown = sorted(set(comm_types) - set(known))
        if unknown:
            raise LayoutError(f"--cp-comm-type {' '.join(unknown)}: without Transformer Engine use {', '.join(known)}")
        if num_layers is not None and len(comm_types) not in (1, num_layers):
            raise LayoutError(
                f"--cp-comm-type gives {len(comm_types)} types: give one, or one per layer ({f.num_layers} {num_layers})"
            )
        if hierarchical_sizes is not None:
            product = 1
            for size in hierarchical_sizes:
                product *= size
            if len(hierarchical_sizes) != 2 or product != self.cp:
                raise LayoutError(
                    f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical_sizes))} must be two sizes "
                    f"(a2a, p2p) whose product is {f.cp} {self.cp}"
                )
        if self.cp == 1:
            return
        if "a2a+p2p" in comm_types and hierarchical_sizes is None:
            raise LayoutError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (A x P = CP)")
        for comm_type, a2a in (("a2a", self.cp), ("a2a+p2p", (hierarchical_sizes or [1])[0])):
            if comm_type in comm_types:
                self._check_a2a_heads(comm_type, a2a, heads, query_groups)

    def _check_a2a_heads(self, comm_type: str, a2a: int, heads: int, query_groups: int) -> None:
        f = self.flags
        heads_per_rank = heads // self.tp
        # megatron-core's attention keeps one query group per TP rank when there are fewer groups than ranks
        groups_per_rank = max(query_groups // self.tp, 1)
        if heads_per_rank % a2a or groups_per_rank % a2a:
            raise LayoutError(
                f"--cp-comm-type {comm_type}: the all-to-all over {a2a} ranks splits each TP rank's attention heads "
                f"({heads_per_rank}) and query groups ({groups_per_rank}); both must be divisible by {a2a}: change "
                f"--num-attention-heads / --num-query-groups / {f.tp}, or use --cp-comm-type p2p"
            )

    def microbatches(self, global_batch_size: int, micro_batch_size: int, flag: str | None = None) -> int:
        """Micro-batches per step; the global batch must split evenly over micro batch x DP."""
        f = self.flags
        per_step = micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise LayoutError(
                f"{flag or f.global_batch_size} {global_batch_size} is not divisible by {f.micro_batch_size} "
                f"{micro_batch_size} x data-parallel size {self.dp} (= world size {self.world_size} / (TP {self.tp} x "
                f"PP {self.pp} x CP {self.cp})) = {per_step}"
            )
        return global_batch_size // per_step

    def check_global_batch(
        self, global_batch_size: int, micro_batch_size: int, group_size: int | None = None, flag: str | None = None
    ) -> int:
        """Micro-batches per step of a global batch, with the interleaved schedule's rules
        (Megatron-LM's validate_args): its micro-batches go in groups of ``group_size``
        (--microbatch-group-size-per-virtual-pipeline-stage, default PP)."""
        flag = flag or self.flags.global_batch_size
        m = self.microbatches(global_batch_size, micro_batch_size, flag)
        if self.vpp is None:
            return m
        n = self.pp if group_size is None else group_size
        if n > m or n < self.pp:
            raise LayoutError(
                f"interleaved pipeline schedule: {flag} {global_batch_size} gives {m} micro-batches per step, but "
                f"--microbatch-group-size-per-virtual-pipeline-stage {n} must lie in [PP={self.pp}, M={m}]; "
                "raise --global-batch-size or lower --micro-batch-size"
            )
        if 0 < m % n < self.pp:
            raise LayoutError(
                f"interleaved pipeline schedule: {m} micro-batches per step ({flag} {global_batch_size}) leave a "
                f"remainder of {m % n} when grouped by --microbatch-group-size-per-virtual-pipeline-stage {n}; it "
                f"must be 0 or >= {self.flags.pp} {self.pp}"
            )
        return m

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """DDP's gradient-reduction group: data parallel with context parallel."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data parallel of the expert parameters: their gradient-reduction group."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def experts_per_rank(self) -> int:
        return (self.num_experts or 0) // self.ep

    @property
    def model_parallel(self) -> int:
        """TP x PP: the grad-norm all-reduce group."""
        return self.tp * self.pp

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    @property
    def interleaved(self) -> bool:
        return self.vpp is not None

    def layers_per_chunk(self, num_layers: int) -> int:
        """Layers of one model chunk (one virtual stage on one PP rank)."""
        return num_layers // (self.pp * self.virtual_stages)
