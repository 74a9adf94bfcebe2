"""The run's settings as frozen, typed sections, one per concern; the parser is generated from them.

Each section is a dataclass whose fields are Megatron-LM core_v0.16.1 flags (name = dest, default,
type, a doc string per field: base.py). ``Settings`` (settings.py) holds the built sections beside
Megatron-LM's flat ``args.<dest>`` view; components take their own section, not the namespace.
"""

from .base import EXTENSION, Section, add_section_arguments, field_docs, flag_fields
from .checkpoint import CheckpointSection
from .data import DataSection
from .logs import LoggingSection
from .model import ModelSection
from .optimizer import OptimizerSection
from .profiling import ProfilingSection
from .schedule import ScheduleSection

__all__ = [
    "EXTENSION",
    "CheckpointSection",
    "DataSection",
    "LoggingSection",
    "ModelSection",
    "OptimizerSection",
    "ProfilingSection",
    "ScheduleSection",
    "Section",
    "add_section_arguments",
    "field_docs",
    "flag_fields",
]
