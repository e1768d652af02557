"""The mount's own FUSE session: the kernel's protocol spoken here, without libfuse or pyfuse3.

Why: the kernel can serve a warm file with no request at all (no-open, no flush, kept page
cache) and a hot request can be answered in a few microseconds on a plain reader thread; pyfuse3,
which the mount used before, can do neither (docs/design.md, "The mount's own FUSE session").

One idea per module; only ``dispatch`` knows both the protocol and a file system:

* ``abi``: opcodes, flags and one struct per kernel struct (fuse.h, protocol 7.45);
* ``requests``: bytes read from the device to frozen request objects (no I/O);
* ``replies``: results to the bytes of an answer, and the reply object (no I/O);
* ``notify``: notifications to the kernel (invalidate, store, retrieve) and their gates;
* ``device``: the /dev/fuse descriptor: reads, writes, ioctls, liveness;
* ``mount`` (and ``reaper``): mount(2) or fusermount3, lazy unmount, unmount after a crash;
* ``session``: INIT, the reader thread, requests in flight, interrupts, shutdown;
* ``dispatch``: requests to a file system's fast (reader thread) or slow (trio) paths.
"""
