"""The columns of a job's reading position (SimJob.state, the engine's job table).

What every step changes, kept as numpy columns so that a step advances all running jobs at once
(engine._advance_vector, the compiled LRU advance in lru_kernel.py); LOOKED, SYNCED and EXPECTED
are the epoch's look-ups and the expected cached share of the rest (SimJob.unread_expected),
which a step and a snapshot take in as columns (JobTable.sync). BOUND starts one column per
resource of estimator.pipeline.RESOURCES (seconds bound by it).
"""

from estimator.pipeline import RESOURCES

CONSUMED, POS, REMOTE, HIT, EPOCH_READ, EPOCH_REMOTE, TAIL_MISS, DRIFT_M, DRIFT_T, LOOKED, SYNCED, EXPECTED, BOUND = range(13)
N_ADVANCED = DRIFT_M  # the columns before it are what `advance` moves
N_COLUMNS = BOUND + len(RESOURCES)
