"""``python -m tpu_dist.bench``: the same as the ``tpu-dist-bench`` command."""

import sys

from tpu_dist.bench import main

if __name__ == "__main__":
    sys.exit(main())
