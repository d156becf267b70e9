"""Memory planning: per-rank bytes of a training job, by component, from its settings alone."""
