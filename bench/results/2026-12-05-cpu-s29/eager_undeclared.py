"""The eager experts judged as a stranger's backend: no model_points_only declaration (rule 4's default allowance)."""
import dataclasses
from moe_lora_harness.backends.eager import BACKEND as _EAGER
BACKEND = dataclasses.replace(_EAGER, name="eager_default", model_points_only=False)
