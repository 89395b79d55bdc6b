import sys

from attn_dispatch.demo.cli import main

sys.exit(main())
