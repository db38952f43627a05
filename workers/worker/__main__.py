"""`python -m threadline.workers.worker`: one worker process (the supervisor spawns these)."""

import gc

# No collection while the imports build the ~110,000 objects a worker keeps for its whole life (they
# were scanned ~0.2 s of a start's ~1.4 s); `settle_heap` freezes them and turns collection back on.
gc.disable()

from threadline.workers.worker.process import main  # noqa: E402

main()
