import sys

from ampscope.cli import main

sys.exit(main())
