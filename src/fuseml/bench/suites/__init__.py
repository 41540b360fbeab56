"""Benchmark suites: each module has ``cases(quick: bool) -> Iterable[Case]``, ``PLOT``
(how to draw it, or None for a table only) and ``README`` (how to tabulate it: one spec,
or a list of them for several tables)."""

from fuseml.bench.suites import (
    dlrm,
    elementwise,
    interaction,
    linear,
    lora,
    mlp,
    models,
    overhead,
    softmax,
    tuning,
)

SUITES = {
    "elementwise": elementwise,
    "softmax": softmax,
    "dlrm": dlrm,
    "interaction": interaction,
    "linear": linear,
    "mlp": mlp,
    "lora": lora,
    "models": models,
    "overhead": overhead,
    "tuning": tuning,
}
