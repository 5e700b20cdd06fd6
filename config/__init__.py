"""The run's configuration: the ground floor of the house (imports nothing of ours, no Ray).

- schema.py: the typed sections (msgspec Structs) and RunConfig;
- overrides.py: `section.key=value` overrides, typed;
- validate.py: cross-field rules, every `auto` resolved once;
- recipes.py: the named recipes (tiny, gpu1_0p6b, bird_1p7b, bird_32b);
- placement.py: the one pure placement function; memory.py: the per-GPU memory arithmetic;
- layout.py: the run directory's paths; context.py: RunContext, what every actor is built from
  beside its config section (run id, run dir, Redis URL, logging, stream settings).

Callers import the public names from here: `from config import RunConfig, apply_overrides, ConfigError`.
"""
from config.context import RunContext
from config.overrides import apply_overrides
from config.schema import (
                           AssemblerConfig,
                           ClusterConfig,
                           ConfigError,
                           CoordinatorConfig,
                           DataConfig,
                           GeneratorConfig,
                           LearnerConfig,
                           LoggingConfig,
                           LoraConfig,
                           ModelConfig,
                           RunConfig,
                           ScorerConfig,
)
from config.validate import (
                           check,
                           check_attention,
                           check_inputs,
                           check_multi_node,
                           may_be_off_policy,
                           resolve_correction,
                           to_dict,
                           validate,
)

__all__ = ["AssemblerConfig", "ClusterConfig", "ConfigError", "CoordinatorConfig", "DataConfig", "GeneratorConfig",
           "LearnerConfig", "LoggingConfig", "LoraConfig", "ModelConfig", "RunConfig", "RunContext", "ScorerConfig", "apply_overrides", "check",
           "check_attention", "check_inputs", "check_multi_node", "may_be_off_policy", "resolve_correction",
           "to_dict", "validate"]
