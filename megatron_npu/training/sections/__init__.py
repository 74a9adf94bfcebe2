"""The run's settings as frozen, typed sections, one per concern; the parser is generated from them.

Each section is a dataclass whose fields are Megatron-LM core_v0.16.1 flags (name = dest, default,
type, a doc string per field: base.py). ``Settings`` (settings.py) holds the built sections beside
Megatron-LM's flat ``args.<dest>`` view; components take their own section, not the namespace.
"""

from .base import EXTENSION, Section, add_section_arguments, field_docs, field_fates, flag_fields
from .base import field_policies as _field_policies
from .checkpoint import CheckpointSection
from .data import DataSection
from .distributed import DistributedSection
from .fsdp import FsdpSection
from .init import InitSection
from .logs import LoggingSection
from .misc import MiscSection
from .model import ModelSection
from .moe import MoeSection
from .optimizer import OptimizerSection
from .precision import MixedPrecisionSection
from .profiling import ProfilingSection
from .schedule import ScheduleSection
from .tokenizer import TOKENIZER_TYPES, TokenizerSection
from .training import ReplacedFlags, TrainingSection

#: Every section, in the parser's order (Megatron-LM's groups); ``ReplacedFlags`` is parsed, never held.
ALL_SECTIONS: tuple[type[Section], ...] = (
    ModelSection,
    OptimizerSection,
    ScheduleSection,
    TrainingSection,
    ReplacedFlags,
    InitSection,
    CheckpointSection,
    MixedPrecisionSection,
    DistributedSection,
    DataSection,
    TokenizerSection,
    LoggingSection,
    ProfilingSection,
    MiscSection,
    MoeSection,
    FsdpSection,
)


def field_policies() -> tuple:
    """The ``FlagPolicy`` rows the sections' fields carry (``policy.FLAG_POLICY`` joins them to its own)."""
    return _field_policies(ALL_SECTIONS)


__all__ = [
    "ALL_SECTIONS",
    "EXTENSION",
    "TOKENIZER_TYPES",
    "CheckpointSection",
    "DataSection",
    "DistributedSection",
    "FsdpSection",
    "InitSection",
    "LoggingSection",
    "MiscSection",
    "MixedPrecisionSection",
    "ModelSection",
    "MoeSection",
    "OptimizerSection",
    "ProfilingSection",
    "ReplacedFlags",
    "ScheduleSection",
    "Section",
    "TokenizerSection",
    "TrainingSection",
    "add_section_arguments",
    "field_docs",
    "field_fates",
    "field_policies",
    "flag_fields",
]
