"""Which GPU an xdist worker of a GPU check uses (``scripts/gpu-check.sh`` with
``CHECK_GPUS``): one pytest run spreads its tests over several GPUs, each worker on one of
them, round robin. Imported by conftest.py before torch asks the driver for devices (which
fixes the visible set), so it imports nothing but the standard library."""

from __future__ import annotations


def worker_gpu(gpus: str, worker: str) -> str | None:
    """The device (an entry of ``gpus``, "0,1,2,3") for xdist worker ``worker`` ("gw5"), or
    None: no list, or not an xdist worker. A list entry that is not a device index raises
    ValueError naming CHECK_GPUS."""
    names = [g.strip() for g in gpus.split(",") if g.strip()]
    if not names or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    bad = [g for g in names if not g.isdigit()]
    if bad:
        raise ValueError(f"CHECK_GPUS: expected device indices such as 0,1,2,3, got {gpus!r}")
    return names[int(worker[2:]) % len(names)]
