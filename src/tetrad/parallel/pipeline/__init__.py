"""Pipeline parallelism: pure schedules, their checker, simulator, partitioner and timelines."""

from tetrad.parallel.pipeline.check import check_schedule
from tetrad.parallel.pipeline.partition import (
    balance,
    even_split,
    llama_layer_costs,
    parse_split,
    stage_costs,
)
from tetrad.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Step,
    build_schedule,
    placement,
    rank_stages,
    stage_to_rank,
    steps,
)
from tetrad.parallel.pipeline.simulate import Costs, simulate, simulate_schedule
from tetrad.parallel.pipeline.timeline import (
    Event,
    Timeline,
    plot_timeline,
    save_chrome_trace,
    to_chrome_trace,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Event",
    "Step",
    "Timeline",
    "balance",
    "build_schedule",
    "check_schedule",
    "even_split",
    "llama_layer_costs",
    "parse_split",
    "placement",
    "plot_timeline",
    "rank_stages",
    "save_chrome_trace",
    "simulate",
    "simulate_schedule",
    "stage_to_rank",
    "stage_costs",
    "steps",
    "to_chrome_trace",
]
