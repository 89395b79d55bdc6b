"""An example third-party attention backend for attn_dispatch (backend name ``gather``).

The registry finds it through the ``attn_dispatch.backends`` entry point
(``attn_gather.plugin:register``); the kernel lives in ``attn_gather.backend``, imported only
when a runner binds it.
"""

__version__ = "0.1.0"
