"""Frozen configuration: the base model's shape (model.py), the engine's knobs and how their
automatic choices are settled (engine.py), the cluster's knobs (cluster.py), and the OpenMP
wait policy of a serving process (openmp.py). The only
place defaults live: the CLI's flags are generated from these fields (cli.py)."""

from loraserve.config.cluster import ROUTING_POLICIES, ClusterConfig
from loraserve.config.engine import (
    ATTENTION_BACKEND_NAMES,
    LORA_BACKEND_ENV,
    LORA_BACKEND_NAMES,
    LORA_DTYPES,
    MODEL_DTYPES,
    EngineConfig,
)
from loraserve.config.knobs import knob
from loraserve.config.model import ATTN_MODULES, LORA_MODULES, MLP_MODULES, ModelConfig, RopeScaling

__all__ = ["ATTENTION_BACKEND_NAMES", "ATTN_MODULES", "LORA_BACKEND_ENV", "LORA_BACKEND_NAMES",
           "LORA_DTYPES", "LORA_MODULES", "MLP_MODULES", "MODEL_DTYPES", "ROUTING_POLICIES",
           "ClusterConfig", "EngineConfig", "ModelConfig", "RopeScaling", "knob"]
