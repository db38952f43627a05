"""The test suite. Importing it (pytest does, before the first conftest) lets Python write compiled
code to __pycache__ even where the environment sets PYTHONDONTWRITEBYTECODE, as this machine's
does: without it, every xdist process of every run compiled and assertion-rewrote all the test
modules again, ~6 s of CPU each (docs/testing.md)."""

import sys

sys.dont_write_bytecode = False
