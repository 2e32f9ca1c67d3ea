"""python -m bdh_train ... (also what torchrun -m bdh_train runs)."""

import sys

from bdh_train.cli import main

sys.exit(main())
