"""How long OpenMP's workers spin in an engine process, set before torch loads GNU libgomp
(torch's and the native kernels' OpenMP), which reads its environment once, when it is loaded.

After each parallel region libgomp's workers busy-wait up to GOMP_SPINCOUNT iterations for the
next one before they sleep. Its default, 300,000, kept a core busy about 9 ms after a region on a
two-core AMD EPYC: nearly a whole decode step (about 11 ms), so the core was never free for the
server's thread or a second engine on the host, and two engines on two cores stalled each other's
streams for over a minute. Inside a step the next kernel comes within tens of microseconds, which
3,000 iterations (about 0.1 ms) bridge: one stream's inter-token latency through `portcullis
engine` on SmolLM2 Q4_1 (alternated runs) was 11.0 ms at 3,000, 10.5-10.7 at 10,000 to 100,000
and 12.1 at 1,000. At 10,000 a victim's small requests beside a unique-grammar request took
42-49 ms against 28-32 at 3,000 (tests/reliability/test_noisy_neighbour.py, which failed its 3x
bound in one of two runs at 10,000).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

SPINCOUNT = "3000"


def bound_spinning(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set GOMP_SPINCOUNT unless the user chose how OpenMP waits (GOMP_SPINCOUNT or OMP_WAIT_POLICY).
    Call it before anything imports torch: a later change is not seen by libgomp."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPINCOUNT
