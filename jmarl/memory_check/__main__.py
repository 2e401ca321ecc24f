"""`python -m jmarl.memory_check`: see `jmarl.memory_check.cli`."""

import sys

from jmarl.memory_check.cli import main

sys.exit(main())
