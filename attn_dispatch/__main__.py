import sys

from attn_dispatch._cli import main

sys.exit(main())
