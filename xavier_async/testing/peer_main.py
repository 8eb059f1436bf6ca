"""Entry point of a peer process: ``python -m xavier_async.testing.peer_main FD SPEC_JSON``
(started by :class:`~xavier_async.testing.PeerProcess`)."""

import json
import sys
from multiprocessing.connection import Connection

from .peer_process import _child

_child(Connection(int(sys.argv[1])), json.loads(sys.argv[2]))
