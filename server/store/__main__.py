"""`python -m recorder_server.store`: compile the store's loops into numba's disk cache.

The image build and `make test` run this ahead of any server, so that the first session with
a store loads the loops in about a second instead of compiling them.
"""

import logging

from .kernels import _load_all

logging.basicConfig()
raise SystemExit(0 if _load_all() else 1)
