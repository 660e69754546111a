"""``python -m bdlora.train --config job.yaml`` (also under ``accelerate launch -m bdlora.train``)."""

import sys

from .trainer import main

if __name__ == "__main__":
    sys.exit(main())
