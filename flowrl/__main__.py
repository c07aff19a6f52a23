import sys

from flowrl.cli import main


sys.exit(main())
