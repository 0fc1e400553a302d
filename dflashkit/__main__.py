import sys

from dflashkit.cli import main

sys.exit(main())
