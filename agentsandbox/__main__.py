import sys

from agentsandbox.cli import main

sys.exit(main())
