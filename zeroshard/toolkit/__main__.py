"""`torchrun ... -m zeroshard.toolkit reshard|consolidate ...`: see zeroshard.toolkit.distributed."""

import sys

from zeroshard.toolkit.distributed import main

sys.exit(main())
