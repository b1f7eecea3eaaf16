"""``trainer eval`` and the lm-eval model ``trainer`` (importing this module registers it with lm-eval).

The code lives in torchtitan_ext/evaluation/: ``lm.py`` (:class:`NativeLM`, :func:`evaluate`) and ``cli.py``
(lm_eval's command line).
"""

from torchtitan_ext.evaluation.cli import main
from torchtitan_ext.evaluation.lm import HAVE_LM_EVAL, INSTALL_HINT, NativeLM, evaluate

__all__ = ["HAVE_LM_EVAL", "INSTALL_HINT", "NativeLM", "evaluate", "main"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
