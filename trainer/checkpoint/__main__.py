"""``python -m trainer.checkpoint list|inspect PATH``."""

import sys

from trainer.checkpoint.cli import main

sys.exit(main())
