"""`python -m recorder_server.store`: compile the store's loops into numba's disk cache.

The image build and `make test` run this ahead of any server, so that the first session with
a store loads the loops in about a second instead of compiling them. With arguments it is
`rollout-recorder store ARGS` (`python -m recorder_server.store merge A B -o OUT`).
"""

import logging
import sys

if len(sys.argv) > 1:
    # Arguments used to be ignored: a merge must not end as a silent warm-up that exits 0.
    from ..cli.main import main

    raise SystemExit(main(["store", *sys.argv[1:]]))

from .kernels import _load_all

logging.basicConfig()
raise SystemExit(0 if _load_all() else 1)
