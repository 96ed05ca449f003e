"""
C{python -m svcd.devkit.upstream}: the scripted model server's process
(L{svcd.devkit.upstream.server.main}).
"""

from svcd.devkit.upstream.server import main

if __name__ == "__main__":
    main()
