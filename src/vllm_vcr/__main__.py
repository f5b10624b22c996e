import sys

from .cli import main

if __name__ == "__main__":  # (not when a spawned child process imports it as its parent's main module)
    sys.exit(main())
