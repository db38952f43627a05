"""`python -m threadline.workers.worker`: one worker process (the supervisor spawns these)."""

from threadline.workers.worker.process import main

main()
