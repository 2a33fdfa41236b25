"""``python -m autoshard.profile`` (under torchrun): the ``autoshard profile`` command."""
import sys

from .command import main

sys.exit(main())
