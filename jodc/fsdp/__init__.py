"""FSDP engines behind one interface: ODC (point-to-point, per-device microbatch counts, one barrier per
minibatch), collective (all_gather / psum_scatter in lock-step), XLA-SPMD (NamedSharding under plain jit: what
JAX users do today) and an unsharded reference, sharing one core (`engine`), registered by name (`ENGINES`), each
stating its own facts (`lockstep`, `default_planner`, ...) in its class; `from_nnx` adapts a Flax NNX model."""
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.collective_engine import CollectiveEngine
from jodc.fsdp.engine import Engine, NonFiniteStepError, StepResult
from jodc.fsdp.flax_model import NNXStagedModel, from_nnx
from jodc.fsdp.odc_engine import ODCEngine
from jodc.fsdp.optim import OptimizerConfig
from jodc.fsdp.reference_engine import ReferenceEngine
from jodc.fsdp.registry import ENGINES, engine_class, make_engine
from jodc.fsdp.xla_spmd_engine import XlaSpmdEngine
from jodc.fsdp.stages import ContextParallel, GroupLayout, Stage, StagedModel
from jodc.fsdp.cp_batch import minibatch_from_cp_plan

__all__ = ["ENGINES", "CollectiveEngine", "ContextParallel", "Engine", "GroupLayout", "MinibatchArrays", "NNXStagedModel",
           "NonFiniteStepError", "ODCEngine", "OptimizerConfig", "ReferenceEngine", "XlaSpmdEngine", "Stage",
           "StagedModel", "StepResult", "engine_class", "from_nnx", "make_engine",
           "minibatch_from_cp_plan"]
