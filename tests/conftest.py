"""Test-wide settings.

NETGAIN_COMPILE=0: the codecs run eagerly in every test process and the ranks and workers they
spawn (which inherit it), so no test pays torch.compile's start-up per process. Compiled and
eager codes are bit-identical; tests/test_fused.py checks that with the compiler forced on.
"""

import os

os.environ.setdefault("NETGAIN_COMPILE", "0")
