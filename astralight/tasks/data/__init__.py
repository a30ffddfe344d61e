"""Prompt sources over local data files (JSONL, JSON, Parquet, ``save_to_disk`` folders).

Named by import path in YAML, e.g. ``astralight.tasks.data.DAPOMathSource``; see
:mod:`astralight.tasks.data.source` (the generic :class:`FileSource`) and
:mod:`astralight.tasks.data.presets` (the paper's data sets).
"""

from astralight.tasks.data.presets import (CODE_TEMPLATE, EVAL_PRESETS, MATH_TEMPLATE,
                                           AIME24Source, AIME25Source, AMCSource,
                                           DAPOMathSource, DeepCoderSource, DeepScaleRSource,
                                           MATH500Source, MathEvalSource, MathEvalSuite,
                                           MinervaSource)
from astralight.tasks.data.source import FileSource, MultiBenchmarkSource, SkipRow

__all__ = ["FileSource", "MultiBenchmarkSource", "SkipRow", "DAPOMathSource",
           "DeepScaleRSource", "DeepCoderSource", "MathEvalSource", "AIME24Source",
           "AIME25Source", "AMCSource", "MATH500Source", "MinervaSource", "MathEvalSuite",
           "EVAL_PRESETS", "MATH_TEMPLATE", "CODE_TEMPLATE"]
