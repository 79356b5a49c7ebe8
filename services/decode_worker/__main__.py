"""`python -m services.decode_worker`: the dual-role worker, starting in the decode role."""

import sys

from services.worker.main import main
from shared.policy.roles import DECODE

sys.exit(main(DECODE))
