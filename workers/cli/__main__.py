"""`python -m threadline.workers.cli`: the `threadline` command."""

from threadline.workers.cli.main import main

main()
