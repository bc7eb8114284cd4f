import sys

from worker.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
