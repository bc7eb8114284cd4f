import sys

from worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
