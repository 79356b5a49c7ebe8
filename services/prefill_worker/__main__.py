"""`python -m services.prefill_worker`: the dual-role worker, starting in the prefill role."""

import sys

from services.worker.main import main
from shared.policy.roles import PREFILL

sys.exit(main(PREFILL))
