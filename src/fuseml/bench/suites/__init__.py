"""Benchmark suites: each module has ``cases(quick: bool) -> Iterable[Case]``, ``PLOT``
(how to draw it) and ``README`` (how to tabulate it)."""

from fuseml.bench.suites import dlrm, elementwise, softmax

SUITES = {"elementwise": elementwise, "softmax": softmax, "dlrm": dlrm}
