"""Event kinds of the simulator's heap (ints: the hot loop compares them, in rough order of
frequency)."""

E_ITER_DONE = 0  # a decode iteration ended (worker)
E_KV_ARRIVE = 1  # prefix KV installed on the decode worker (worker, request)
E_PREFILL_DONE = 2  # prefix compute ended (worker, request)
E_ARRIVAL = 3  # the next trace request arrives
E_TELEMETRY = 4  # every worker publishes (20 ms)
E_PREFILL_RETRY = 5  # admission retry of the head request (worker, request)
E_SAMPLE = 6  # time-series sample (1 s)
E_CONTROL = 7  # FluidRole decision interval (1 s)
E_MIGRATE_ARRIVE = 8  # a migrated decode's KV installed on its new worker (worker, request)
E_DRAIN_CHECK = 9  # a draining worker's link went idle (worker)
E_SWITCH_DONE = 10  # the in-place flip after a drain ended (worker, switch epoch)
E_DRAIN_TIMEOUT = 11  # drain_timeout_s after a drain started (worker, switch epoch)
