"""``python -m trainer.tools.bench ...`` is ``trainer bench ...``."""

import sys

from trainer.tools.bench import main

sys.exit(main())
