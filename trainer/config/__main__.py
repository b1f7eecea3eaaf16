import sys

from trainer.interrupt import quiet_keyboard_interrupt

quiet_keyboard_interrupt()  # Ctrl-C in the pre-flight: one line, exit 130

from trainer.config.reference import main  # noqa: E402

sys.exit(main())
