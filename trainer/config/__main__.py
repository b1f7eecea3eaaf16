import sys

from trainer.config.reference import main

sys.exit(main())
