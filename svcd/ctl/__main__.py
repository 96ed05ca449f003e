"""
C{python -m svcd.ctl}: svcctl without its console script.
"""

from svcd.ctl.main import main

raise SystemExit(main())
