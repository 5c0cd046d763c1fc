"""``python -m trainbus``: the command line (see :mod:`trainbus._cli`)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
