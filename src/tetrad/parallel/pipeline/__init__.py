"""Pipeline parallelism: pure schedules, their checker, simulator, partitioner and timelines;
the stage split and the runtime that executes a schedule."""
