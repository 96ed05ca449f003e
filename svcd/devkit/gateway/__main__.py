"""
C{python -m svcd.devkit.gateway}: what C{dev/gateway} runs
(L{svcd.devkit.gateway.command.main}).
"""

import sys

from svcd.devkit.gateway.command import main

if __name__ == "__main__":
    sys.exit(main())
