"""Measure a hardware profile of the running cluster (``autoshard profile``), under torchrun."""
from .measure import (COMPUTE_OPS, DEFAULT_SIZES, MEASURED_KINDS, ProfileError, add_profile_arguments, fit_alpha_beta,
                      fit_optimizer, main, measure_profile, op_work, overlap_fraction, run_profile)

__all__ = ["COMPUTE_OPS", "DEFAULT_SIZES", "MEASURED_KINDS", "ProfileError", "add_profile_arguments", "fit_alpha_beta",
           "fit_optimizer", "main", "measure_profile", "op_work", "overlap_fraction", "run_profile"]
