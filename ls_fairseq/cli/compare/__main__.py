"""python -m ls_fairseq.cli.compare RUN_A RUN_B ..."""
import sys

from .command import main

sys.exit(main())
