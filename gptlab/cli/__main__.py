"""`python -m gptlab.cli ...` (how torchrun starts `gptlab train` in several processes)."""

import sys

from gptlab.cli import main

sys.exit(main())
