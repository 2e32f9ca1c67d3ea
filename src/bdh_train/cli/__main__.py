"""`python -m bdh_train.cli`: the same CLI as `bdh-train` and `python -m bdh_train`."""

import sys

from bdh_train.cli import main

sys.exit(main())
