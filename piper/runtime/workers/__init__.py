"""The Ray actor that owns one device (`worker`): joins torch.distributed, builds its executor,
runs steps; and what the driver asks of a set-up worker (`worker_queries`). The top room.

May import: every other room.
"""
