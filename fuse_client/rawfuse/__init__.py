"""A raw /dev/fuse front end with FUSE passthrough for cached items (Linux >= 6.9, root).

protocol.py: the wire format; device.py: mount(2), cloned fds and backing-file ioctls;
server.py: the request loop over the shared DatasetOperations (fuse_client/operations.py).
"""
