"""Mimose's internals: its policy (``policy``), the probes that give its first estimate, the
shuttling collector, the scaling of probe steps to any size, the per-op estimator and its trust
rule, the features, the greedy scheduler, the finer choices' times, and the probe layout (which
blocks are alike, which a probe leaves out). Mimose imports no baseline."""
