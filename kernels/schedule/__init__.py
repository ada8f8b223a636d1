"""Stream schedules: a small interface for issuing multi-stream GPU work, a CUDA implementation, and a
CPU `Recorder` that checks the same program for races with vector clocks.

`CudaSchedule` lives in `kernels.schedule.cuda` (imported lazily: it needs CUDA).
"""
from moe_lora_harness.kernels.schedule.interface import MAIN, BufferRef, Schedule, ScheduleError, buffer_ref, named
from moe_lora_harness.kernels.schedule.recorder import Hazard, Op, Race, Recorder

__all__ = ["MAIN", "BufferRef", "Schedule", "ScheduleError", "buffer_ref", "named",
           "Hazard", "Op", "Race", "Recorder"]
