import sys

from attn_dispatch.cli import main

sys.exit(main())
