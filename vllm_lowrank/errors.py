"""The error every refused input raises (imported by :mod:`vllm_lowrank.config`
and :mod:`vllm_lowrank.inputs` alike, so that neither imports the other's
module for it)."""


class LowRankConfigError(ValueError):
    """A ``--kv-compression`` setting (or a file it names) is invalid; the
    message names the problem and the fix."""
