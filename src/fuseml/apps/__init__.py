"""The applications built on the library: the ``fuseml`` command line (``cli``), DLRM
``train``, ``predict`` and ``profile``, the ``demo`` and ``env`` reports.

Library modules (ops, nn, models, optimize) never import from here.
"""
