"""``python -m epl.launch``: epl-launch (epl.launch.cli)."""
import sys

from epl.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
