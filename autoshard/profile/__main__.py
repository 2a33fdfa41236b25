"""``python -m autoshard.profile`` (under torchrun): the ``autoshard profile`` command."""
import sys

from .measure import main

sys.exit(main())
