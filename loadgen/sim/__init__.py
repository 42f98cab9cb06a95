"""The chunk-KV cache simulator: policies, eviction, model shapes, the paper-shaped sweep."""

from loadgen.sim.policies import (DYNAMIC_POLICIES, ORACLE_POLICIES, POLICIES, SimConfig, SimResult,
                                  closed_form_ratio, simulate)
from loadgen.sim.shapes import MODEL_SHAPES, ModelShape, format_bytes, parse_bytes

__all__ = ["DYNAMIC_POLICIES", "ORACLE_POLICIES", "POLICIES", "SimConfig", "SimResult",
           "closed_form_ratio", "simulate", "MODEL_SHAPES", "ModelShape", "format_bytes", "parse_bytes"]
